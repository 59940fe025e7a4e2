"""Which detector owns which job: per-job leases in Redis, spread by rendezvous hashing.

One detector owns every job by default. Several split the jobs between them: each job's
lease (``Keys.lease("detector", job)``) names its owner and expires unless renewed, so
the jobs of a detector that dies move to the others within one lease TTL, and those of
one that stops move at once (it releases them). Detectors register themselves in a
sorted set scored by expiry; a free job goes first to the live detector that rendezvous
hashing prefers (spreading jobs evenly without coordination), and to anyone once it has
been free for a whole TTL (so a preferred detector that is slow to act cannot strand it).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable

import redis.asyncio as aioredis

from trainguard.lease import LeaseHolder
from trainguard.state import Keys

ROLE = "detector"


def preferred(job: str, instances: Iterable[str]) -> str | None:
    """The instance rendezvous hashing gives ``job`` to (stable as instances come and go)."""

    def weight(instance: str) -> bytes:
        return hashlib.blake2b(f"{job}\0{instance}".encode(), digest_size=8).digest()

    ranked = sorted(instances, key=weight, reverse=True)
    return ranked[0] if ranked else None


class Leases:
    """Job leases and the instance registry of one detector (one round trip each).

    The lease mechanics are :class:`trainguard.lease.LeaseHolder`'s; this class adds the
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

    def key(self, job: str) -> str:
        return self.keys.lease(ROLE, job)

    async def acquire(self, job: str) -> bool:
        return await self._held.acquire(self.key(job))

    async def renew(self, jobs: Iterable[str]) -> set[str]:
        """Extend our leases; returns the jobs whose lease we no longer hold."""
        by_key = {self.key(job): job for job in jobs}
        return {by_key[key] for key in await self._held.renew(by_key)}

    async def release(self, jobs: Iterable[str]) -> None:
        await self._held.release(self.key(job) for job in jobs)

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

    async def deregister(self) -> None:
        await self.redis.zrem(self.registry_key, self.instance)
