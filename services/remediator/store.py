"""The remediator's state in Redis: incidents, the blocklist, and the view of a job.

Writes that other replicas could race (incidents, the blocklist) go through the leader's
fenced scripts (:mod:`.leader`), so a deposed leader writes nothing; the counters behind
the restart budget and the cause history are plain sorted sets of times, written by any
replica (each entry is added once: ``ZADD NX`` by attempt number or diagnosis id).
"""

from __future__ import annotations

import contextlib
import time

import msgspec
import redis.asyncio as aioredis

from trainguard.codec import decode_durable, encode_durable
from trainguard.errors import DecodeError
from trainguard.schemas import Diagnosis, Incident
from trainguard.state import (
    BlocklistEntry,
    Keys,
    decode_node_record,
    decode_progress,
    encode_blocklist_entry,
)

from .endings import HOUR, attempt_member, attempt_of
from .engine import JobView, is_open
from .leader import Leadership


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

    async def of(self, job: str) -> list[Incident]:
        """Every incident of ``job``, open or not."""
        raw = await self.redis.hgetall(self.keys.incidents(job))
        return [_incident(value) for value in raw.values()]

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

    async def note_cause(self, d: Diagnosis, now: float) -> None:
        """Count an occurrence of ``d``'s cause (for "escalate after N in an hour")."""
        await self.redis.zadd(self.keys.cause_times(d.job, d.cause), {d.id: now}, nx=True)

    async def note_attempt(self, job: str, attempt: int | None, at: float) -> None:
        """Count an ended attempt of ``job`` against its hourly restart budget, once per
        attempt number (its failure, seen on several hosts, then restarted by us)."""
        await self.redis.zadd(self.keys.restarts(job), {attempt_member(attempt): at}, nx=True)

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
        ended = [str(m) for m in await redis.zrange(self.keys.restarts(job), 0, -1)]
        view.restarts_last_hour = len(ended)
        view.ended_attempts = frozenset(a for a in map(attempt_of, ended) if a is not None)
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
