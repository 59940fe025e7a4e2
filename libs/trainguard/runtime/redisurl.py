"""Redis Sentinel URLs: which sentinels to ask, for which primary.

redis-py's ``from_url`` knows one server only; a primary that Sentinel may fail over to a
replica is named by the sentinels that watch it and the name they know it by::

    redis+sentinel://[user:password@]host:port[,host:port...]/master-name[/db]
    rediss+sentinel://...   (TLS to the sentinels and to the data nodes)

``user:password`` are the *sentinels'* credentials (``sentinel sentinel-user/-pass``); the
data nodes take the role's credentials like any other Redis URL (``TRAINGUARD_CREDENTIALS``).
A host without a port is a sentinel on 26379. Only the standard library here: the settings
validate URLs with it before anything connects.
"""

from __future__ import annotations

import dataclasses
from typing import Final
from urllib.parse import unquote

from trainguard.contract.errors import ConfigError

SENTINEL_SCHEMES: Final = ("redis+sentinel", "rediss+sentinel")
SENTINEL_PORT: Final = 26379
_SYNTAX: Final = "redis+sentinel://[user:password@]host:port[,host:port...]/master-name[/db]"


@dataclasses.dataclass(frozen=True)
class SentinelTarget:
    """The parts of a Sentinel URL."""

    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    tls: bool = False
    username: str | None = None
    password: str | None = None


def is_sentinel_url(url: str) -> bool:
    return url.split("://", 1)[0] in SENTINEL_SCHEMES


def parse_sentinel_url(url: str) -> SentinelTarget:
    """Split a Sentinel URL; a :class:`ConfigError` says what is wrong and the syntax."""

    def bad(why: str) -> ConfigError:
        return ConfigError(f"redis_url={url!r}: {why}; expected {_SYNTAX}")

    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SENTINEL_SCHEMES:
        raise bad("not a Sentinel URL")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username, password = (unquote(user) or None), (unquote(secret) if colon else None)
    sentinels: list[tuple[str, int]] = []
    for part in hosts.split(","):
        host, colon, port = part.strip().rpartition(":") if ":" in part else (part, "", "")
        host = host.strip()
        if not host:
            raise bad(f"sentinel {part!r} has no host")
        try:
            sentinels.append((host, int(port) if colon else SENTINEL_PORT))
        except ValueError:
            raise bad(f"sentinel {part!r} has a port that is not a number") from None
    master, _, db = path.strip("/").partition("/")
    if not master:
        raise bad("no master name after the sentinels")
    if db and not db.isdigit():
        raise bad(f"database {db!r} is not a number")
    return SentinelTarget(tuple(sentinels), master, int(db or 0), tls=scheme.startswith("rediss"),
                          username=username, password=password)
