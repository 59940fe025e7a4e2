"""Which detector owns which job: per-job leases in Redis, spread by rendezvous hashing.

One detector owns every job by default. Several split the jobs between them: each job's
lease (``Keys.lease("detector", job)``) names its owner and expires unless renewed, so
the jobs of a detector that dies move to the others within one lease TTL, and those of
one that stops move at once (it releases them). Detectors register themselves in a
sorted set scored by expiry; a free job goes first to the live detector that rendezvous
hashing prefers (spreading jobs evenly without coordination), and to anyone once it has
been free for a whole TTL (so a preferred detector that is slow to act cannot strand it).

A detector's name is stable across its restarts (:mod:`.identity`), so taking a lease that
already names this detector succeeds at once: a restarted detector takes its jobs back
without waiting out the leases of the process it replaces.

A detector killed outright leaves its leases behind until they expire; its peers see
its NATS connection gone (:mod:`trainguard.runtime.presence`) and take its jobs over at
once (:meth:`Leases.take_from`), the one rendezvous hashing now prefers first.

While Redis does not answer, no lease can be renewed, and none can be taken either: a
detector keeps judging the jobs it owns for as long as their leases are valid **by its own
clock** (a monotonic deadline, counted from before the request that last extended them, so
it ends no later than Redis's own expiry), then stops judging them until Redis is back.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable

import redis.asyncio as aioredis

from trainguard.runtime.lease import LeaseHolder
from trainguard.runtime.state import Keys

ROLE = "detector"


def preferred(job: str, instances: Iterable[str]) -> str | None:
    """The instance rendezvous hashing gives ``job`` to (stable as instances come and go)."""

    def weight(instance: str) -> bytes:
        return hashlib.blake2b(f"{job}\0{instance}".encode(), digest_size=8).digest()

    ranked = sorted(instances, key=weight, reverse=True)
    return ranked[0] if ranked else None


class Leases:
    """Job leases and the instance registry of one detector (one round trip each).

    The lease mechanics are :class:`trainguard.runtime.lease.LeaseHolder`'s; this class adds the
    detector's naming (a lease per job, held under the instance name) and its registry.
    """

    def __init__(self, redis: aioredis.Redis, keys: Keys, instance: str, ttl: float,
                 registry_key: str) -> None:
        self.redis = redis
        self.keys = keys
        self.instance = instance
        self.ttl = ttl
        self.registry_key = registry_key
        self._held = LeaseHolder(redis, instance, ttl)
        self.valid_until: dict[str, float] = {}
        """Job -> monotonic time until which our lease on it is certainly still ours."""

    def key(self, job: str) -> str:
        return self.keys.lease(ROLE, job)

    @property
    def holder(self) -> LeaseHolder:
        """The lease holder, for writes fenced by a job's lease."""
        return self._held

    async def acquire(self, job: str) -> bool:
        """Take the job's lease if it is free or already ours (a restarted us)."""
        started = time.monotonic()
        taken = await self._held.take(self.key(job))
        if taken:
            self.valid_until[job] = started + self.ttl
        return taken

    async def take_from(self, job: str, previous: str) -> bool:
        """Take the job's lease if it is free or still names ``previous``, a detector
        known to be gone (:mod:`trainguard.runtime.presence`)."""
        started = time.monotonic()
        taken = await self._held.take_from(self.key(job), previous)
        if taken:
            self.valid_until[job] = started + self.ttl
        return taken

    async def renew(self, jobs: Iterable[str]) -> set[str]:
        """Extend our leases; returns the jobs whose lease we no longer hold."""
        started = time.monotonic()
        by_key = {self.key(job): job for job in jobs}
        lost = {by_key[key] for key in await self._held.renew(by_key)}
        for job in by_key.values():
            if job in lost:
                self.valid_until.pop(job, None)
            else:
                self.valid_until[job] = started + self.ttl
        return lost

    async def release(self, jobs: Iterable[str]) -> None:
        jobs = list(jobs)
        for job in jobs:
            self.valid_until.pop(job, None)
        await self._held.release(self.key(job) for job in jobs)

    def lapsed(self, jobs: Iterable[str], now: float) -> list[str]:
        """Of ``jobs``, those whose lease may have expired by ``now`` (``time.monotonic``)."""
        return [job for job in jobs if self.valid_until.get(job, 0.0) <= now]

    async def owners(self, jobs: Iterable[str]) -> dict[str, str | None]:
        by_key = {self.key(job): job for job in jobs}
        return {by_key[key]: owner for key, owner in (await self._held.owners(by_key)).items()}

    async def heartbeat(self) -> list[str]:
        """Say we are alive; returns every live instance (us included), sorted."""
        now = time.time()
        pipe = self.redis.pipeline(transaction=False)
        pipe.zadd(self.registry_key, {self.instance: now + self.ttl})
        pipe.zremrangebyscore(self.registry_key, "-inf", now)
        pipe.zrangebyscore(self.registry_key, now, "+inf")
        pipe.expire(self.registry_key, max(60, int(self.ttl * 10)))
        results = await pipe.execute()
        return sorted(results[2])

    async def deregister(self, instance: str | None = None) -> None:
        """Take ``instance`` (default: us) out of the registry, so hashing passes it by."""
        await self.redis.zrem(self.registry_key, instance or self.instance)
