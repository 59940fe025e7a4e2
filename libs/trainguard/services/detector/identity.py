"""Who this detector is: a name that survives its restart, and no live twin that shares it.

The name is what the detector's job leases hold. A stable one lets a restarted detector
take its jobs back at once (:meth:`trainguard.runtime.lease.LeaseHolder.take`) instead of waiting
out the leases its dead predecessor still held: ``instance_id`` when set, else the host
name, with the health port when one is fixed (two detectors of one host then differ).

Two live processes must never share a name: both would judge, and alert on, the same jobs.
So each process claims its name in Redis (``<prefix>:detector:claim:<name>``, a lease
renewed with the job leases) with who it is: host, pid and a random token. A name that is
claimed already is taken over only when the claimant is provably gone: a process of this
host that no longer runs, or this very pid (a new container, or a detector of this process
that stopped without releasing). Anything else (a live process, another machine) may be a
twin: this process then runs under a unique name (``<name>-<pid>-<token>``) and the old
leases expire as they did before. A process that finds its claim taken later steps aside
the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import uuid
from collections.abc import Callable, Collection
from typing import Literal

import redis.asyncio as aioredis

from trainguard.runtime.lease import LeaseHolder
from trainguard.runtime.pids import pid_running

log = logging.getLogger("trainguard.detector")

ClaimStanding = Literal["free", "mine", "predecessor", "twin"]

_LIVE_HERE: set[str] = set()
"""Tokens of the detectors running in this process (a pid does not tell them apart)."""


def default_name(instance_id: str, health_port: int, host: str | None = None) -> str:
    """The name a detector runs under unless its claim says otherwise."""
    if instance_id:
        return instance_id
    host = host or socket.gethostname()
    return f"{host}:{health_port}" if health_port else host


@dataclasses.dataclass(frozen=True)
class Claim:
    """Who holds a name: written as ``<host> <pid> <token>``."""

    host: str
    pid: int
    token: str

    def encode(self) -> str:
        return f"{self.host} {self.pid} {self.token}"

    @classmethod
    def decode(cls, raw: str | None) -> Claim | None:
        parts = (raw or "").split(" ")
        if len(parts) != 3 or not parts[1].isdigit():
            return None
        return cls(parts[0], int(parts[1]), parts[2])


def judge_claim(found: Claim | None, me: Claim, *, running: Callable[[int], bool],
                live_here: Collection[str]) -> ClaimStanding:
    """May ``me`` run under a name that ``found`` claims?"""
    if found is None:
        return "free"
    if found.token == me.token:
        return "mine"
    if found.host != me.host or found.token in live_here:
        return "twin"  # another machine (alive, for all we know), or a detector beside us
    if found.pid == me.pid:
        return "predecessor"  # our pid but not our token: a process before this one
    return "twin" if running(found.pid) else "predecessor"


class Identity:
    """The name this process runs under, and its claim in Redis.

    Args:
        redis: the shared client.
        key_of: the claim key of a name.
        wanted: the stable name (:func:`default_name`).
        ttl: the claim expires this long after its last renewal (the lease TTL).
    """

    def __init__(self, redis: aioredis.Redis, key_of: Callable[[str], str], wanted: str,
                 ttl: float) -> None:
        self.redis = redis
        self.key_of = key_of
        self.wanted = wanted
        self.ttl = ttl
        self.me = Claim(socket.gethostname().replace(" ", "_"), os.getpid(), uuid.uuid4().hex)
        self.name = wanted
        self._claim = LeaseHolder(redis, self.me.encode(), ttl)

    async def claim(self) -> str:
        """Claim :attr:`wanted`, or a unique name when a twin may hold it; returns it."""
        key = self.key_of(self.wanted)
        if not await self._claim.acquire(key):
            value = await self.redis.get(key)
            raw = value.decode() if isinstance(value, bytes) else value
            found = Claim.decode(raw)
            verdict = judge_claim(found, self.me, running=pid_running, live_here=_LIVE_HERE)
            taken = verdict != "twin" and await self._claim.take_from(key, raw or "")
            if not taken:
                return await self._aside(f"claimed by {raw!r}")
            if verdict == "predecessor":
                log.info("detector %s: taking over the name from a process that is gone (%s)",
                         self.wanted, raw)
        self.name = self.wanted
        _LIVE_HERE.add(self.me.token)
        return self.name

    async def keep(self) -> bool:
        """Renew the claim; False: another process has taken the name (a twin)."""
        return await self._claim.take(self.key_of(self.name))

    async def step_aside(self) -> str:
        """Give the name up for a unique one (after :meth:`keep` said it was taken)."""
        return await self._aside("taken over by another process")

    async def release(self) -> None:
        _LIVE_HERE.discard(self.me.token)
        await self._claim.release([self.key_of(self.name)])

    async def _aside(self, why: str) -> str:
        name = f"{self.wanted}-{self.me.pid}-{self.me.token[:6]}"
        log.warning("detector name %s is %s: running as %s (set a distinct instance_id for "
                    "each detector of a host)", self.wanted, why, name)
        await self._claim.acquire(self.key_of(name))
        self.name = name
        _LIVE_HERE.add(self.me.token)
        return name
