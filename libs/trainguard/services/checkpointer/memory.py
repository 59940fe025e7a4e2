"""The ranks' memory snapshots, as the coordinator keeps them beside the checkpoints.

Each rank reports its newest verified memory snapshot (``SnapshotReport`` on
``<prefix>.<job>.snap.<rank>``, telemetry, at most ~1/s). The coordinator keeps the newest
per rank in Redis (``<p>:ckpt:<job>:memory``, a hash rank -> :class:`Held`), forgets a
rank's ``ttl`` seconds after its last report (its process is gone, or it stopped taking
them) and sums them up per job (:func:`summarize`): the newest step every rank holds,
the oldest kept, their age, the host memory and copy cost of the heaviest rank, and the
newest step every rank's buddy holds a copy of.

Writes are batched: the telemetry handler only notes the newest report per rank in
process memory (:class:`Pending`), and the coordinator's timer writes them in one pipeline
per tick. A rank's snapshot steps are its own; the summary is what they say together.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

import msgspec
import redis.asyncio as aioredis

from trainguard.contract.rpc import MemorySummary
from trainguard.contract.schemas import SnapshotReport

from .keys import CkptKeys

DEFAULT_TTL = 600.0


class Held(msgspec.Struct, kw_only=True):
    """A rank's newest report and when the coordinator received it (its own clock)."""

    at: float
    report: SnapshotReport


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Held)


def summarize(held: Mapping[int, Held], now: float, ttl: float = DEFAULT_TTL
              ) -> MemorySummary | None:
    """What the ranks' newest reports say together; None when no fresh one is left.

    A report older than ``ttl`` (by the coordinator's clock) is left out, and so are ranks
    at or above the world size of the newest report (the job shrank: they are gone)."""
    fresh = {rank: h.report for rank, h in held.items() if now - h.at <= ttl}
    if not fresh:
        return None
    world = max(fresh.values(), key=lambda r: (r.time, r.taken)).world_size
    if world > 0:
        fresh = {rank: r for rank, r in fresh.items() if rank < world}
    if not fresh:
        return None
    reports = list(fresh.values())
    newest = min(r.step for r in reports)
    taken = min(r.taken for r in reports if r.step == newest)
    oldest = max(min(r.kept_steps, default=r.step) for r in reports)
    # A step's time is its first rank's, for the newest and the oldest alike: the oldest
    # step every rank holds is never younger than the newest.
    oldest_taken = min((r.oldest_taken or r.taken) for r in reports
                       if min(r.kept_steps, default=r.step) == oldest)
    return MemorySummary(
        newest_step=newest, oldest_step=oldest,
        taken=taken, age=max(0.0, now - taken) if taken else 0.0,
        oldest_taken=oldest_taken,
        oldest_age=max(0.0, now - oldest_taken) if oldest_taken else 0.0,
        host_bytes=max(r.host_bytes for r in reports), bytes=max(r.bytes for r in reports),
        copy_seconds=max(r.copy_seconds for r in reports),
        check_seconds=max(r.check_seconds for r in reports),
        every=max(r.every for r in reports), ranks=sorted(fresh), world_size=world,
        buddy_step=min((max(r.buddy_sent, default=-1) for r in reports), default=-1),
        buddy_bytes=max(r.buddy_bytes for r in reports))


class Pending:
    """The newest report per (job, rank) since the last write: what the handler notes."""

    def __init__(self) -> None:
        self._by: dict[tuple[str, int], Held] = {}

    def note(self, report: SnapshotReport, now: float) -> None:
        """The newest replaces any before it (core NATS keeps one sender's order)."""
        self._by[(report.job, report.rank)] = Held(at=now, report=report)

    def take(self) -> dict[tuple[str, int], Held]:
        out, self._by = self._by, {}
        return out

    def __len__(self) -> int:
        return len(self._by)


class MemoryStore:
    """The Redis side: one hash per job, rank -> :class:`Held` JSON, expiring ``ttl``
    seconds after its last write."""

    def __init__(self, redis: aioredis.Redis, keys: CkptKeys, ttl: float = DEFAULT_TTL) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl = ttl

    async def write(self, held: Mapping[tuple[str, int], Held]) -> set[str]:
        """Write each rank's newest; returns the jobs written."""
        if not held:
            return set()
        pipe = self.redis.pipeline(transaction=False)
        jobs: set[str] = set()
        for (job, rank), h in held.items():
            pipe.hset(self.keys.memory(job), str(rank), _encoder.encode(h))
            jobs.add(job)
        for job in jobs:
            pipe.expire(self.keys.memory(job), max(1, int(self.ttl + 0.999)))
        await pipe.execute()
        return jobs

    async def read(self, job: str) -> dict[int, Held]:
        raw = await self.redis.hgetall(self.keys.memory(job))
        out: dict[int, Held] = {}
        for k, v in (raw or {}).items():
            rank = k.decode() if isinstance(k, bytes) else str(k)
            try:
                out[int(rank)] = _decoder.decode(v)
            except (ValueError, msgspec.DecodeError, msgspec.ValidationError):
                continue  # written by another version: the rank's next report replaces it
        return out

    async def forget(self, job: str, ranks: Iterable[int]) -> None:
        stale = [str(r) for r in ranks]
        if stale:
            await self.redis.hdel(self.keys.memory(job), *stale)

    async def summary(self, job: str, now: float | None = None) -> MemorySummary | None:
        """The job's summary; ranks gone stale are removed on the way."""
        now = time.time() if now is None else now
        held = await self.read(job)
        await self.forget(job, (r for r, h in held.items() if now - h.at > self.ttl))
        return summarize(held, now, self.ttl)
