"""The remediator's state in Redis: incidents, the blocklist, and the view of a job.

Writes that other replicas could race (incidents, the blocklist) go through the leader's
fenced scripts (:mod:`.leader`), so a deposed leader writes nothing; the counters behind
the restart budget and the cause history are plain sorted sets of times.
"""

from __future__ import annotations

import contextlib
import time

import msgspec
import redis.asyncio as aioredis

from trainguard.codec import decode_durable, encode_durable
from trainguard.envelope import uuid7
from trainguard.errors import DecodeError
from trainguard.schemas import Incident
from trainguard.state import (
    BlocklistEntry,
    Keys,
    decode_node_record,
    decode_progress,
    encode_blocklist_entry,
)

from .engine import JobView, is_open
from .leader import Leadership

HOUR = 3600.0


def _incident(raw: str | bytes) -> Incident:
    return decode_durable(raw.encode() if isinstance(raw, str) else raw, Incident)


class Store:
    def __init__(self, redis: aioredis.Redis, keys: Keys, leader: Leadership) -> None:
        self.redis = redis
        self.keys = keys
        self.leader = leader

    # -- incidents ------------------------------------------------------------------------
    async def load(self, job: str, ident: str) -> Incident | None:
        raw = await self.redis.hget(self.keys.incidents(job), ident)
        return _incident(raw) if raw else None

    async def open_of(self, job: str) -> list[Incident]:
        """The open incidents of ``job``."""
        raw = await self.redis.hgetall(self.keys.incidents(job))
        return [inc for inc in map(_incident, raw.values()) if is_open(inc)]

    async def open_all(self) -> list[Incident]:
        """Every open incident of every job (from the open set)."""
        found = []
        for member in await self.redis.smembers(self.keys.open_incidents()):
            job, _, ident = str(member).partition("|")
            inc = await self.load(job, ident)
            if inc is not None and is_open(inc):
                found.append(inc)
        return found

    async def save(self, inc: Incident) -> None:
        """Write ``inc`` and its membership of the open set (fenced: raises NotLeader)."""
        await self.leader.save_incident(self.keys.incidents(inc.job), inc.id,
                                        encode_durable(inc), self.keys.open_incidents(),
                                        f"{inc.job}|{inc.id}", is_open(inc))

    async def note_cause(self, inc: Incident, now: float) -> None:
        """Count a new incident of its cause (for "escalate after N in an hour")."""
        await self.redis.zadd(self.keys.cause_times(inc.job, inc.cause), {inc.id: now})

    async def note_restart(self, job: str) -> None:
        """Count a restart against the job's hourly budget."""
        await self.redis.zadd(self.keys.restarts(job), {uuid7(): time.time()})

    async def block(self, host: str, entry: BlocklistEntry) -> None:
        await self.leader.hset(self.keys.blocklist(), host, encode_blocklist_entry(entry))

    # -- what a decision sees -------------------------------------------------------------
    async def view(self, job: str, cause: str) -> JobView:
        """The job's hosts (not blocklisted), budgets, cause history and progress."""
        redis = self.redis
        now = time.time()
        view = JobView()
        blocked = set(await redis.hkeys(self.keys.blocklist()))
        async for key in redis.scan_iter(match=self.keys.node(job, "*")):
            raw = await redis.get(key)
            with contextlib.suppress(DecodeError):
                record = decode_node_record(raw) if raw else None
                if record is not None and record.host not in blocked:
                    view.hosts[record.host] = record
        await redis.zremrangebyscore(self.keys.restarts(job), 0, now - HOUR)
        view.restarts_last_hour = int(await redis.zcard(self.keys.restarts(job)))
        times = await redis.zrangebyscore(self.keys.cause_times(job, cause), now - HOUR, now,
                                          withscores=True)
        view.cause_count_last_hour = len(times)
        if times:
            view.first_seen_at = float(min(float(pair[1]) for pair in times))
        raw = await redis.get(self.keys.progress(job))
        if raw:
            with contextlib.suppress(msgspec.ValidationError, msgspec.DecodeError):
                p = decode_progress(raw)
                view.attempt, view.last_step = p.attempt, p.last_step
        return view
