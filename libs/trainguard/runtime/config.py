"""One typed, frozen configuration object per process.

Values come from, lowest to highest: the dataclass defaults (which work with the
embedded control plane of ``trainguard up``), ``TRAINGUARD_<FIELD>`` environment
variables (named by :func:`trainguard.contract.envnames.setting`, the rule the client's variables
follow too), and explicit overrides (CLI flags). A ``TRAINGUARD_*`` variable that no
setting reads is an error naming the nearest known name (:func:`check_variables`).
Services subclass :class:`Settings` to add their own fields; the same loader handles them.
An unknown override key or a value of the wrong type is a :class:`ConfigError` that names
the setting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import os
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, get_type_hints

import msgspec

from trainguard.contract.envnames import GUARD_KEYS, PREFIX, TRUE, setting
from trainguard.contract.errors import ConfigError, InvalidToken
from trainguard.contract.subjects import DEFAULT_PREFIX, Subjects
from trainguard.core.auth import Access, TlsFiles, access_from

from .logs import DEFAULT_FORMAT, FORMATS, level_of
from .redisurl import SENTINEL_SCHEMES, parse_sentinel_url

DEFAULT_NATS_PORT = 4222
DEFAULT_REDIS_PORT = 6379
MAX_REPLICAS = 5
"""JetStream's own bound on a stream's replicas."""

S = TypeVar("S", bound="Settings")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    """Settings every trainguard process shares."""

    nats_url: str = f"nats://127.0.0.1:{DEFAULT_NATS_PORT}"
    redis_url: str = f"redis://127.0.0.1:{DEFAULT_REDIS_PORT}/0"
    prefix: str = DEFAULT_PREFIX
    connect_timeout: float = 5.0
    """Bound on the first NATS/Redis connect; reconnects after that go on forever."""
    health_host: str = "127.0.0.1"
    """Bind address of /livez, /readyz, /metrics: ``0.0.0.0`` in a pod, so the kubelet and
    Prometheus reach it."""
    health_port: int = 0
    """Port of /livez, /readyz, /metrics; 0: ``base_port`` + the service's offset
    (:mod:`trainguard.runtime.ports`), or any free port (logged at start) without a base port."""
    base_port: int = 0
    """Base of the fixed health ports (``trainguard up`` defaults to 9460); 0: none."""
    publish_retry_s: float = 10.0
    """How long a service retries a durable publish that JetStream did not acknowledge
    (no responders, timeout: a stream leader election after a NATS node loss). The retry
    carries the same message id, so the stream dedupes one that did land."""
    max_deliver: int = 5
    """Deliveries of a message whose handler keeps failing before it is dead-lettered."""
    transient_max_s: float = 3600.0
    """How old a message may grow while its handler meets a transient dependency error
    (Redis or NATS away) before it is dead-lettered (kept for a replay) instead of
    redelivered."""
    ack_wait: float = 30.0
    fetch_batch: int = 64
    fetch_wait: float = 1.0
    """How long one pull request of a durable consumer waits for messages. The server keeps
    sending to a request until it expires, redeliveries included: where replicas share a
    consumer and hand each other's messages back, a shorter wait lets the others have them
    sooner (the detector's is shorter)."""
    otel_exporter: str = ""
    """none, console, file:<path> or otlp; empty: OTLP if OTEL_EXPORTER_OTLP_ENDPOINT is set."""
    log_level: str = "INFO"
    log_format: str = DEFAULT_FORMAT
    """``text`` (human lines) or ``json`` (one object per line with the context keys of
    :mod:`trainguard.runtime.logs`); the CLI reads it before any settings object exists."""
    credentials: str = ""
    """This process's role credentials file (``trainguard credentials``; ``trainguard up``
    writes one per role under ``<data-dir>/creds``); empty: anonymous access."""
    nats_creds: str = ""
    """A NATS ``.creds`` file (JWT + nkey) for servers with decentralised auth; it replaces
    the NATS user of ``credentials`` (whose Redis user stays in use)."""
    auth_mode: Literal["static", "jwt"] = "static"
    """How ``trainguard up`` runs its embedded nats-server: ``static``, one user per role
    (``<data-dir>/creds/<role>.json``); ``jwt``, operator mode, a credential per identity
    (``<role>.creds`` for the services, per host and per rank minted by
    ``trainguard credentials --jwt``)."""
    rank_creds_ttl: float = 3600.0
    """``jwt`` mode: seconds a rank's credential from the control plane's issuer lives (its
    agent renews it at two thirds of that)."""
    nats_nkey: str = ""
    """A NATS nkey seed file."""
    nats_tls_ca: str = ""
    nats_tls_cert: str = ""
    nats_tls_key: str = ""
    redis_tls_ca: str = ""
    """CA bundle for ``rediss://`` URLs."""
    redis_tls_cert: str = ""
    redis_tls_key: str = ""
    stream_replicas: int = 1
    """Replicas of every JetStream stream, durable consumer and KV bucket (1: one
    nats-server; 3 on a 3-node cluster, as in ``deploy/``). Provisioning applies a change to
    existing streams."""

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.prefix)

    @property
    def access(self) -> Access:
        """Credentials and TLS for NATS and Redis, read from the files the settings name."""
        return access_from(
            self.credentials, nats_creds=self.nats_creds, nats_nkey=self.nats_nkey,
            nats_tls=TlsFiles(self.nats_tls_ca, self.nats_tls_cert, self.nats_tls_key),
            redis_tls=TlsFiles(self.redis_tls_ca, self.redis_tls_cert, self.redis_tls_key))

    def redis_key(self, *parts: str) -> str:
        """A Redis key under this deployment's prefix: ``<prefix>:<part>:<part>``."""
        return ":".join((self.prefix, *parts))

    def replace(self: S, **changes: Any) -> S:
        return load_settings(type(self), env={}, overrides={**dataclasses.asdict(self), **changes})


@functools.cache
def _load_installed_settings() -> None:
    """Import every installed service and command once, so their settings classes exist
    (``Settings.__subclasses__``) and their fields are known names. A plugin that does not
    load is reported where it is run; here it only adds no names."""
    from importlib.metadata import entry_points

    for group in ("trainguard.services", "trainguard.commands"):
        for ep in entry_points(group=group):
            with contextlib.suppress(Exception):
                ep.load()


def _settings_classes(root: type[Settings]) -> list[type[Settings]]:
    out, todo = [], [root]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


def known_variables(cls: type[Settings] | None = None, *,
                    installed: bool = True) -> frozenset[str]:
    """Every ``TRAINGUARD_*`` variable a trainguard process may be given, derived, never
    listed by hand: the fields of every settings class (the shared :class:`Settings`, every
    installed service's and command's, ``cls``), and the names the Guard reads or a job
    forwards (:data:`trainguard.contract.envnames.GUARD_KEYS`). One environment serves every service
    of ``trainguard up``, so a detector threshold is known to the diagnoser too.
    ``installed`` False: only the classes imported so far (cheap; no service imported)."""
    if installed:
        _load_installed_settings()
    classes = _settings_classes(Settings) + ([cls] if cls is not None else [])
    return frozenset({setting(f.name) for c in classes for f in dataclasses.fields(c)}
                     | GUARD_KEYS)


def check_variables(env: Mapping[str, str], cls: type[Settings] | None = None) -> None:
    """:class:`ConfigError` for a ``TRAINGUARD_*`` variable that no setting reads (a typo
    would otherwise be ignored in silence), naming the nearest known name."""
    names = sorted(k for k in env if k.startswith(PREFIX))
    if not names:
        return
    known = known_variables(cls, installed=False)
    if all(k in known for k in names):
        return
    known = known_variables(cls)  # importing the services costs ~1 s: only when needed
    unknown = [k for k in names if k not in known]
    if not unknown:
        return
    name = unknown[0]
    near = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    hint = f"; did you mean {near[0]}?" if near else ""
    more = f" (and {len(unknown) - 1} more: {', '.join(unknown[1:])})" if len(unknown) > 1 else ""
    raise ConfigError(f"unknown environment variable {name}{hint}{more}: no trainguard "
                      f"setting reads it (the settings are in docs/configuration.md)")


def _coerce(name: str, raw: Any, hint: Any) -> Any:
    """``raw`` (an environment string or a flag's value) as the field's type, decoded by
    msgspec in lax mode (``"5"`` is an int); a :class:`ConfigError` naming the setting."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if raw is None or (isinstance(raw, str) and raw.lower() in ("", "none", "null")):
            return None
        return _coerce(name, raw, args[0])
    if hint is str:
        return str(raw)
    if hint is bool and isinstance(raw, str):  # the spellings envnames.flag accepts too
        text = raw.strip().lower()
        raw = True if text in TRUE else False if text in ("0", "false", "no", "off") else raw
    try:
        return msgspec.convert(raw.strip() if isinstance(raw, str) else raw, hint,
                               strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(
            f"setting {name}={raw!r} is not a valid {getattr(hint, '__name__', hint)}: {exc}"
        ) from None


def load_settings(
    cls: type[S],
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> S:
    """Build ``cls`` from defaults, then ``env`` (default: ``os.environ``), then overrides.

    Overrides whose value is None are skipped, so argparse namespaces can be passed as
    they are.
    """
    env = os.environ if env is None else env
    check_variables(env, cls)
    hints = get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for name in fields:
        key = setting(name)
        if key in env:
            values[name] = _coerce(key, env[key], hints[name])
    for name, raw in (overrides or {}).items():
        if name not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(f"unknown setting {name!r}; known settings: {known}")
        if raw is not None:
            values[name] = _coerce(name, raw, hints[name])
    settings = cls(**values)
    try:
        settings.subjects  # noqa: B018 - validates the prefix early
    except InvalidToken as exc:
        raise ConfigError(str(exc)) from None
    level_of(settings.log_level, "setting log_level")  # TRAINGUARD_LOG_LEVEL: the CLI's
    if settings.log_format not in FORMATS:
        raise ConfigError(f"setting log_format={settings.log_format!r}: use one of "
                          f"{', '.join(FORMATS)}")
    settings.access  # noqa: B018 - a missing or malformed credentials file fails here
    if not 1 <= settings.stream_replicas <= MAX_REPLICAS:
        raise ConfigError(f"setting stream_replicas={settings.stream_replicas}: JetStream "
                          f"keeps 1 to {MAX_REPLICAS} replicas; use 1 on one server, 3 on a "
                          "3-node cluster")
    for url_field, schemes in (("nats_url", ("nats", "tls")),
                               ("redis_url", ("redis", "rediss", "unix", *SENTINEL_SCHEMES))):
        url = getattr(settings, url_field)
        if url_field == "redis_url" and url.split("://", 1)[0] in SENTINEL_SCHEMES:
            parse_sentinel_url(url)  # a ConfigError names what is wrong
            continue
        for part in url.split(","):
            scheme = part.split("://", 1)[0] if "://" in part else ""
            if scheme not in schemes:
                raise ConfigError(
                    f"{url_field}={url!r} is not a valid URL: expected "
                    f"{' or '.join(s + '://host:port' for s in schemes)}"
                )
    return settings
