"""The catalogue: every checkpoint of every job, its commit state and the resume pointer.

Async access to the Redis layout of :mod:`.keys` through the scripts of :mod:`.scripts`.
Every method that changes more than one key runs one script; the rest are single reads.
Results say what changed (:class:`PointerChange`) so the service can mirror the pointer
into LATEST and publish events exactly for what this replica changed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import redis.asyncio as aioredis

from trainguard.contract.codec import encode_durable
from trainguard.contract.envelope import uuid7
from trainguard.contract.errors import DecodeError
from trainguard.contract.schemas import CheckpointReport, ResumePoint, Topology
from trainguard.runtime.state import Keys, Progress, decode_progress

from . import scripts
from .keys import CkptKeys, member, parse_member
from .records import Record, parse_record, parse_reports


@dataclass(frozen=True)
class PointerChange:
    old: str
    new: str

    @property
    def changed(self) -> bool:
        return self.old != self.new




@dataclass(frozen=True)
class ReportOutcome:
    state: str
    """pending | complete | failing | dup | closed | late | busy"""
    round: str
    reported: int
    world_size: int
    pointer: PointerChange


@dataclass(frozen=True)
class CloseOutcome:
    won: bool
    suspect: str
    pointer: PointerChange


@dataclass(frozen=True)
class MarkOutcome:
    """Result of an onset or a rollback: newly suspect steps and the pointer."""

    state: str
    pointer: PointerChange
    suspect_steps: list[int] = field(default_factory=list)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _strmap(raw: Any) -> dict[str, str]:
    """A hash as str -> str (the client decodes responses; this satisfies the types)."""
    return {_text(k): _text(v) for k, v in (raw or {}).items()}


def _s(value: float | int) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


class Catalogue:
    def __init__(self, redis: aioredis.Redis, prefix: str) -> None:
        self.redis = redis
        self.keys = CkptKeys(prefix)
        self.shared = Keys(prefix)
        r = redis
        self._report = r.register_script(scripts.REPORT)
        self._close = r.register_script(scripts.CLOSE)
        self._onset = r.register_script(scripts.ONSET)
        self._rollback = r.register_script(scripts.ROLLBACK)
        self._expire = r.register_script(scripts.EXPIRE)
        self._deleted = r.register_script(scripts.DELETED)
        self._prune = r.register_script(scripts.PRUNE)

    # -- reports and commits ------------------------------------------------------------
    async def record_report(self, rep: CheckpointReport, *, now: float,
                            deadline: float) -> ReportOutcome:
        k = self.keys
        await self.redis.set(k.since(rep.job), _s(now), nx=True)
        started = (rep.time or now) - rep.seconds_total
        out: list[Any] = await self._report(args=[
            k.base(rep.job), str(rep.step), str(rep.rank), rep.id, encode_durable(rep).decode(),
            str(rep.world_size), str(rep.attempt), rep.path, _s(now), _s(now + deadline),
            uuid7(), "1" if rep.ok else "0", _s(rep.time or now), member(rep.job, rep.step),
            k.deadlines(), rep.job, _s(started), rep.group_token or f"a{rep.attempt}",
            _s(rep.state_since or started)])
        return ReportOutcome(str(out[0]), str(out[1]), int(out[2]), int(out[3]),
                             PointerChange(str(out[4]), str(out[5])))

    async def note_base(self, job: str, step: int, base: int) -> None:
        """An incremental checkpoint's base, shown while it is still pending."""
        await self.redis.hset(self.keys.rec(job, step), "base", str(base))

    async def close(self, rec: Record, status: str, fields: dict[str, str], *,
                    now: float) -> CloseOutcome:
        """Commit or fail ``rec`` if it is still the pending round it was judged as."""
        k = self.keys
        out: list[Any] = await self._close(args=[
            k.base(rec.job), str(rec.step), rec.round, status, _s(now), json.dumps(fields),
            member(rec.job, rec.step), k.deadlines(), k.outbox()])
        return CloseOutcome(bool(int(out[0])), str(out[1]), PointerChange(str(out[2]),
                                                                          str(out[3])))

    async def record(self, job: str, step: int) -> Record | None:
        raw = await self.redis.hgetall(self.keys.rec(job, step))
        return parse_record(job, step, _strmap(raw))

    async def reports(self, job: str, step: int) -> tuple[dict[int, CheckpointReport],
                                                          list[str]]:
        raw = await self.redis.hgetall(self.keys.rec(job, step))
        return parse_reports(_strmap(raw))

    async def newest_good_below(self, job: str, below: int) -> Record | None:
        """The newest committed, trusted and retained checkpoint below step ``below``."""
        for rec in await self.records(job):
            if rec.step < below and rec.good and rec.retained and rec.point:
                return rec
        return None

    async def records(self, job: str, limit: int = 0) -> list[Record]:
        """Records of ``job``, newest step first (``limit`` 0: all)."""
        steps = await self.redis.zrevrange(self.keys.steps(job), 0, limit - 1 if limit else -1)
        if not steps:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for s in steps:
            pipe.hgetall(self.keys.rec(job, int(_text(s))))
        raws = await pipe.execute()
        out = []
        for s, raw in zip(steps, raws, strict=True):
            rec = parse_record(job, int(_text(s)), _strmap(raw))
            if rec is not None:
                out.append(rec)
        return out

    async def due(self, now: float, limit: int = 100) -> list[tuple[str, int]]:
        """Pending checkpoints whose commit deadline has passed."""
        members = await self.redis.zrangebyscore(self.keys.deadlines(), "-inf", _s(now),
                                                 start=0, num=limit)
        return [p for m in members if (p := parse_member(_text(m))) is not None]

    async def forget_deadline(self, job: str, step: int) -> None:
        await self.redis.zrem(self.keys.deadlines(), member(job, step))

    # -- the event outbox ---------------------------------------------------------------
    async def claim_announcement(self, job: str, step: int) -> bool:
        """True for exactly one caller per queued event (SREM is the claim)."""
        return bool(await self.redis.srem(self.keys.outbox(), member(job, step)))

    async def requeue_announcement(self, job: str, step: int) -> None:
        await self.redis.sadd(self.keys.outbox(), member(job, step))

    async def queued_announcements(self, limit: int = 100) -> list[tuple[str, int]]:
        members = await self.redis.srandmember(self.keys.outbox(), limit)
        return [p for m in members or [] if (p := parse_member(_text(m))) is not None]

    # -- the pointer --------------------------------------------------------------------
    async def pointer(self, job: str) -> str | None:
        value = await self.redis.get(self.keys.pointer(job))
        return str(value) if value else None

    async def pin(self, job: str) -> int | None:
        value = await self.redis.get(self.keys.pin(job))
        return int(value) if value else None

    # -- suspects and rollback ----------------------------------------------------------
    async def open_onset(self, job: str, anomaly_id: str, kind: str, step: int | None,
                         at: float) -> MarkOutcome:
        onset = json.dumps({"kind": kind, "step": step, "at": at})
        out: list[Any] = await self._onset(args=[self.keys.base(job), anomaly_id, onset,
                                                 self.keys.outbox(), job])
        return MarkOutcome(str(out[0]), PointerChange(str(out[1]), str(out[2])),
                           [int(s) for s in out[3:]])

    async def close_onset(self, job: str, anomaly_id: str) -> None:
        await self.redis.hdel(self.keys.onsets(job), anomaly_id)

    async def onsets(self, job: str) -> dict[str, Any]:
        raw = await self.redis.hgetall(self.keys.onsets(job))
        return {k: json.loads(v) for k, v in _strmap(raw).items()}

    async def rollback(self, job: str, below: int, *, now: float, reason: str) -> MarkOutcome:
        out: list[Any] = await self._rollback(args=[
            self.keys.base(job), str(below), json.dumps({"below": below, "at": now}), reason,
            self.keys.outbox(), job])
        return MarkOutcome("rolled_back", PointerChange(str(out[0]), str(out[1])),
                           [int(s) for s in out[2:]])

    # -- retention ----------------------------------------------------------------------
    async def expire(self, job: str, steps: Sequence[int], *, delete: bool) -> list[int]:
        if not steps:
            return []
        out: list[Any] = await self._expire(args=[self.keys.base(job), "1" if delete else "0",
                                                  *(str(s) for s in steps)])
        return [int(s) for s in out]

    async def mark_deleted(self, job: str, step: int) -> bool:
        return bool(int(await self._deleted(args=[self.keys.base(job), str(step)])))

    async def prune(self, job: str, limit: int) -> int:
        return int(await self._prune(args=[self.keys.base(job), str(limit)]))

    # -- interval inputs ----------------------------------------------------------------
    async def add_failure(self, job: str, failure_id: str, *, incident: bool, now: float) -> bool:
        k = self.keys
        await self.redis.set(k.since(job), _s(now), nx=True)
        key = k.incidents(job) if incident else k.failures(job)
        return bool(await self.redis.sadd(key, failure_id))

    async def failure_count(self, job: str) -> tuple[int, float | None]:
        """Failures seen (the larger of incidents and crash/hang anomalies: an incident is
        usually opened from those anomalies) and when the job was first seen."""
        k = self.keys
        pipe = self.redis.pipeline(transaction=False)
        pipe.scard(k.failures(job))
        pipe.scard(k.incidents(job))
        pipe.get(k.since(job))
        anomalies, incidents, since = await pipe.execute()
        return max(int(anomalies), int(incidents)), float(since) if since else None

    async def interval(self, job: str) -> dict[str, Any] | None:
        raw = await self.redis.get(self.keys.interval(job))
        return dict(json.loads(raw)) if raw else None

    async def set_interval(self, job: str, value: dict[str, Any]) -> None:
        await self.redis.set(self.keys.interval(job), json.dumps(value))

    # -- shared state owned by others ---------------------------------------------------
    async def progress(self, job: str, max_age: float) -> Progress | None:
        """The detector's progress record, if fresh enough to choose an ``at_step``."""
        raw = await self.redis.get(self.shared.progress(job))
        if not raw:
            return None
        try:
            p = decode_progress(raw)
        except (msgspec.DecodeError, DecodeError):
            return None
        return p if time.time() - p.time <= max_age else None

    async def next_seq(self, job: str) -> int:
        return int(await self.redis.incr(self.shared.cmd_seq(job)))

    async def epoch(self) -> int:
        """Commands carry the remediator leader's epoch: ranks keep the highest epoch they
        have seen per job and refuse lower ones, whoever the issuer."""
        value = await self.redis.get(self.shared.epoch("remediator"))
        return int(value) if value else 0


def point_json(rec: Record, topology: Topology | None = None) -> str:
    """The ResumePoint of a record, encoded exactly as LATEST and rpc ``resume`` carry it."""
    return encode_durable(ResumePoint(job=rec.job, step=rec.step, path=rec.path,
                                      checkpoint_id=rec.id, world_size=rec.world_size,
                                      topology=topology)).decode()


def saved_topology(reports: Mapping[int, CheckpointReport]) -> Topology | None:
    """The layout the ranks saved from, as the lowest rank that says reported it."""
    for rank in sorted(reports):
        if reports[rank].topology is not None:
            return reports[rank].topology
    return None
