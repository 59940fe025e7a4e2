"""The remediator's state in Redis: incidents, the blocklist, and the view of a job.

Writes that other replicas could race (incidents, the blocklist) go through the leader's
fenced scripts (:mod:`.leader`), so a deposed leader writes nothing; the counters behind
the restart budget and the cause history are plain sorted sets of times, written by any
replica (each entry is added once: ``ZADD NX`` by generation or diagnosis id). Node
records, too, are written by any replica, from the agents' durable hellos: each write is
a compare-and-set on the hello's time (:func:`.endings.supersedes`), so replicas and
redeliveries agree on the newest.
"""

from __future__ import annotations

import contextlib
import time
from typing import Final

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import WatchError

from trainguard.contract.codec import decode_durable, encode_durable
from trainguard.contract.errors import DecodeError
from trainguard.contract.schemas import Diagnosis, Incident, JobMode, NodeHello, RecoveryReport
from trainguard.runtime.state import (
    BlocklistEntry,
    Keys,
    NodeRecord,
    decode_node_record,
    decode_progress,
    encode_blocklist_entry,
    encode_node_record,
    read_blocklist_entry,
    read_job_mode,
)

from .endings import HOUR, attempt_member, attempt_of, in_job, supersedes
from .engine import JobView, is_open
from .leader import Leadership

READ_BATCH: Final = 1000
"""Keys a scan step and an ``MGET`` of node records take at once."""
LEFT_TTL_S: Final = 86400.0
"""How long the record of a launcher that left stays as a tombstone (ignored by
:meth:`Store.view`): far longer than any redelivery of that host's older hellos."""


def _incident(raw: str | bytes) -> Incident:
    return decode_durable(raw.encode() if isinstance(raw, str) else raw, Incident)


def _node_record(raw: str | bytes | None) -> NodeRecord | None:
    """A stored record; one that is not (written by hand, or garbled) is replaced."""
    if not raw:
        return None
    try:
        return decode_node_record(raw)
    except DecodeError:
        return None


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

    async def note_attempt(self, job: str, generation: int | None, at: float) -> None:
        """Count the ended group ``generation`` of ``job`` (a restart or isolation the
        remediator sent; None: unknown, a new entry) against its hourly restart budget."""
        await self.note_ended(job, attempt_member(generation), at)

    async def note_ended(self, job: str, member: str, at: float) -> None:
        """Count the budget entry ``member`` (:mod:`.endings`) once: its failure, seen on
        several hosts, then restarted by us, is one entry."""
        await self.redis.zadd(self.keys.restarts(job), {member: at}, nx=True)

    async def next_seq(self, job: str) -> int:
        """A collective command's sequence number (shared with the other issuers)."""
        return int(await self.redis.incr(self.keys.cmd_seq(job)))

    async def note_recovery(self, report: RecoveryReport) -> None:
        """Keep a recovery report for the job's incidents (any replica: keyed by its id)."""
        await self.redis.hset(self.keys.recoveries(report.job), report.id,
                              encode_durable(report))

    async def recoveries(self, job: str, now: float) -> tuple[RecoveryReport, ...]:
        """The job's reports of the last hour (older ones are removed as they are read)."""
        key = self.keys.recoveries(job)
        kept: list[RecoveryReport] = []
        stale: list[str | bytes] = []
        for ident, raw in (await self.redis.hgetall(key)).items():
            try:
                report = decode_durable(raw if isinstance(raw, bytes) else raw.encode(),
                                        RecoveryReport)
            except DecodeError:
                stale.append(ident)
                continue
            if now - report.time > HOUR:
                stale.append(ident)
            else:
                kept.append(report)
        if stale:
            await self.redis.hdel(key, *stale)
        return tuple(sorted(kept, key=lambda r: r.time))

    async def block(self, host: str, entry: BlocklistEntry) -> None:
        await self.leader.hset(self.keys.blocklist(), host, encode_blocklist_entry(entry))

    async def blocked(self, now: float) -> set[str]:
        """Hosts whose blocklist entry is in force at ``now`` (an ended one no longer
        counts, even before :meth:`ended` sweeps it)."""
        raw = await self.redis.hgetall(self.keys.blocklist())
        return {str(host) for host, value in raw.items()
                if read_blocklist_entry(value).active(now)}

    async def ended(self, now: float) -> list[tuple[str, bytes | str, BlocklistEntry]]:
        """Entries past their ``expires`` (their TTL, or ``trainguard unblock``), with the
        stored value that :meth:`unblock` compares against."""
        raw = await self.redis.hgetall(self.keys.blocklist())
        found = []
        for host, value in raw.items():
            entry = read_blocklist_entry(value)
            if not entry.active(now):
                found.append((host.decode() if isinstance(host, bytes) else str(host),
                              value, entry))
        return found

    async def unblock(self, host: str, value: bytes | str) -> bool:
        """Remove ``host``'s entry if it still is ``value`` (fenced; False: re-blocked or
        changed meanwhile, kept)."""
        return await self.leader.hdel_if(self.keys.blocklist(), host, value)

    async def record_node(self, hello: NodeHello) -> bool:
        """Store ``hello`` as its host's node record if it is the newest (False: an older
        one, dropped); a ``left`` hello stays as a tombstone for :data:`LEFT_TTL_S`.
        Optimistic (``WATCH``): a concurrent write by another replica makes it decide
        again. Redis errors raise, so the hello is redelivered."""
        key = self.keys.node(hello.job, hello.host)
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    if not supersedes(hello, _node_record(await pipe.get(key))):
                        return False  # leaving the pipeline unwatches
                    pipe.multi()  # type: ignore[no-untyped-call]
                    pipe.set(key, encode_node_record(hello),
                             px=int(LEFT_TTL_S * 1000) if hello.left else None)
                    await pipe.execute()
                    return True
                except WatchError:
                    continue

    async def mode(self, job: str) -> JobMode | None:
        """The job's own mode (``trainguard observe`` / ``act``); None: the policy's."""
        raw = await self.redis.hget(self.keys.modes(), job)
        return read_job_mode(raw) if raw is not None else None

    async def nodes(self, job: str) -> list[NodeRecord]:
        """Every node record of ``job``: the keys scanned :data:`READ_BATCH` a step, the
        records read as many an ``MGET``. A 2,048-host job's view is a few round trips,
        not a ``GET`` a host (0.9-1.4 s on a loaded machine), and a decision reads it up to
        three times before its command goes out, a restart's wait twice a second."""
        keys = [key async for key in self.redis.scan_iter(match=self.keys.node(job, "*"),
                                                         count=READ_BATCH)]
        records = []
        for at in range(0, len(keys), READ_BATCH):
            for raw in await self.redis.mget(keys[at:at + READ_BATCH]):
                record = _node_record(raw)
                if record is not None:
                    records.append(record)
        return records

    # -- what a decision sees -------------------------------------------------------------
    async def view(self, job: str, cause: str) -> JobView:
        """The job's hosts (still launched, not blocklisted), budgets, cause history and
        progress."""
        redis = self.redis
        now = time.time()
        view = JobView()
        blocked = await self.blocked(now)
        for record in await self.nodes(job):
            if in_job(record, blocked):
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
                view.attempt, view.last_step = p.incarnation, p.last_step
                view.generation = p.generation or None
                view.world_size = p.world_size
        view.recoveries = await self.recoveries(job, now)
        return view
