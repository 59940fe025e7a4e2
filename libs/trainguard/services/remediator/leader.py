"""One acting remediator: a leader lease with a fencing token.

The holder renews the lease every ``ttl / 4``; a replica takes over within ``ttl`` of the
holder's death, and within about two renewal periods when the holder's NATS connection
ended with it (its presence, :mod:`trainguard.runtime.presence`). Each new holder draws a
fresh epoch, carried on every command so agents and ranks reject a deposed leader's late
commands, and every write to shared state (blocklist, incidents) is fenced by the lease,
so a deposed leader writes nothing. The
lease mechanics live in :mod:`trainguard.runtime.lease`; epochs come from the replicated NATS
bucket of :mod:`trainguard.runtime.fencing` (a Redis ``INCR`` could repeat after a failover), and
the leader keeps their Redis mirror raised for the readers that only speak Redis.
"""

from __future__ import annotations

import uuid
from typing import NoReturn

import redis.asyncio as aioredis

from trainguard.contract.errors import TrainguardError
from trainguard.runtime.fencing import Epochs, raise_mirror, read_mirror
from trainguard.runtime.lease import LeaseHolder
from trainguard.runtime.presence import Presence
from trainguard.runtime.state import Keys


class NotLeader(TrainguardError):
    """A fenced write refused: this replica no longer holds the leader lease."""


class Leadership:
    def __init__(self, redis: aioredis.Redis, keys: Keys, epochs: Epochs,
                 role: str = "remediator", ttl: float = 3.0,
                 presence: Presence | None = None) -> None:
        self.redis = redis
        self.presence = presence
        """Where a leader gone from the bus shows (its lease token's presence): the lock
        is then taken at once, not after ``ttl``."""
        self.keys = keys
        self.epochs = epochs
        self.role = role
        self.lock = keys.leader(role)
        self.lease = LeaseHolder(redis, uuid.uuid4().hex, ttl)
        self.epoch = 0
        self.leading = False

    async def tick(self) -> bool:
        """Renew or try to take the lease; returns whether this replica leads now."""
        mirror = self.keys.epoch(self.role)
        if self.leading:
            if not await self.lease.renew([self.lock]):
                await raise_mirror(self.redis, mirror, self.epoch)  # heals a failover's loss
                return True
            self.leading = False
        if await self.lease.acquire(self.lock) or await self._take_from_gone():
            try:
                self.epoch = await self.epochs.draw(self.role,
                                                    floor=await read_mirror(self.redis, mirror))
                await raise_mirror(self.redis, mirror, self.epoch)
            except BaseException:
                await self.lease.release([self.lock])  # no epoch: let another replica lead
                raise
            self.leading = True
        return self.leading

    async def _take_from_gone(self) -> bool:
        """Take the lock from a holder gone from the bus (:mod:`trainguard.runtime.presence`)."""
        if self.presence is None:
            return False
        holder = (await self.lease.owners([self.lock]))[self.lock]
        if holder is None or holder == self.lease.holder \
                or not await self.presence.absent(holder):
            return False
        self.presence.forget(holder)
        return await self.lease.take_from(self.lock, holder)

    async def release(self) -> None:
        if self.leading:
            await self.lease.release([self.lock])
            self.leading = False

    async def hset(self, key: str, field: str, value: str | bytes) -> None:
        """A fenced ``HSET``; raises :class:`NotLeader` (nothing written) once deposed."""
        if not await self.lease.hset(self.lock, key, field, value):
            self._deposed(f"write to {key}")

    async def hdel_if(self, key: str, field: str, expected: str | bytes) -> bool:
        """A fenced compare-and-delete of a hash field (False: it changed meanwhile);
        raises :class:`NotLeader` once deposed."""
        done = await self.lease.hdel_if(self.lock, key, field, expected)
        if done is None:
            self._deposed(f"delete from {key}")
        return done

    async def save_incident(self, key: str, field: str, value: str | bytes, open_key: str,
                            member: str, is_open: bool) -> None:
        """Write an incident and its membership of the open set in one fenced step."""
        if not await self.lease.hset_tracked(self.lock, key, field, value, open_key, member,
                                             is_open):
            self._deposed("incident write")

    def _deposed(self, what: str) -> NoReturn:
        self.leading = False
        raise NotLeader(f"lost the {self.role} lock; {what} refused")
