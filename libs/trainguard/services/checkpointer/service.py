"""The checkpoint coordinator service: wiring of reports, events, endpoints and timers.

* ``CheckpointReport`` (durable consumer ``checkpointer`` on REPORTS): record the rank's
  report; once every rank of the world has reported, verify the files and commit, or fail
  the checkpoint. A rank that reports a failed save fails it at once; ranks still missing at
  the commit deadline fail it by the timer. Each outcome is one ``CheckpointCommitted`` on
  ``<prefix>.<job>.event.checkpoint`` (status committed, suspect or failed).
* ``Anomaly``/``Incident`` (durable consumer ``checkpointer-events`` on EVENTS): numeric
  and SDC onsets make checkpoints suspect; crashes, hangs and incidents feed the MTBF.
* Core request/reply (queue group ``checkpointer``, so one replica answers):
  ``rpc.resume``, ``rpc.save``, ``rpc.rollback``, ``rpc.checkpoints``.
* ``SnapshotReport`` telemetry (core, queue group ``checkpointer``): each rank's newest
  memory snapshot, written to Redis on the tick (:mod:`.memory`); ``rpc.checkpoints``
  answers with their summary, and the memory snapshot series follow it.
* After each commit: retention, then the Young/Daly interval (``set_interval`` when it
  moves by more than ``interval_change``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Literal

import msgspec
from nats.aio.msg import Msg

from trainguard.contract.codec import decode_durable
from trainguard.contract.commit_record import COMMIT_FILE, CommitRecord
from trainguard.contract.errors import ConfigError, DecodeError, NotStarted, Reject, Retry
from trainguard.contract.rpc import (
    CATALOGUE,
    RESUME,
    ROLLBACK,
    SAVE,
    CatalogueReply,
    CatalogueRequest,
    ResumeRequest,
    RollbackReply,
    SaveReply,
    error_reply,
)
from trainguard.contract.schemas import (
    Anomaly,
    CheckpointCommitted,
    CheckpointReport,
    Incident,
    ResumePoint,
    SnapshotReport,
    TelemetryMessage,
)
from trainguard.core.connection import flush
from trainguard.runtime.config import Settings
from trainguard.runtime.jobmetrics import CheckpointMetrics, MemorySnapshotMetrics
from trainguard.runtime.logs import get_logger
from trainguard.runtime.service import Consumer, Delivery, Runtime, Service
from trainguard.runtime.topology import ConsumerSpec

from .catalogue import Catalogue, PointerChange, point_json, saved_topology
from .commands import CommandFactory
from .interval import IntervalPolicy
from .latest import remove_latest, write_commit, write_latest
from .memory import MemoryStore, Pending
from .records import Record
from .retention import Entry, expire
from .savenow import SaveNow
from .settings import CheckpointerSettings
from .verify import Integrity, verify_checkpoint

log = get_logger("trainguard.checkpointer")

RPC_QUEUE = "checkpointer"


def commit_record(rec: Record, reports: dict[int, CheckpointReport], base_id: str = ""
                  ) -> CommitRecord:
    """The coordinator's commit record of ``rec``: the digests every rank reported, and an
    increment's base (``base_id``: the base's checkpoint id)."""
    files = {name: digest for r in reports.values() for name, digest in r.files.items()}
    return CommitRecord(job=rec.job, step=rec.step, path=rec.path, checkpoint_id=rec.id,
                        world_size=rec.world_size, files=files, time=time.time(),
                        topology=saved_topology(reports), base=base_of(reports),
                        base_id=base_id)


def base_of(reports: dict[int, CheckpointReport]) -> int | None:
    """The base step the ranks reported (they agree on it before they write)."""
    return next((r.base for r in reports.values() if r.base is not None), None)


class CheckpointerService(Service[CheckpointerSettings]):
    name = "checkpointer"
    settings_type = CheckpointerSettings

    def __init__(self, settings: Settings) -> None:
        if not isinstance(settings, CheckpointerSettings):
            raise ConfigError("CheckpointerService needs CheckpointerSettings "
                              f"(got {type(settings).__name__})")
        super().__init__(settings)
        self.policy = IntervalPolicy(settings.interval_min, settings.interval_max,
                                     settings.mtbf_prior, settings.interval_change)
        self._catalogue: Catalogue | None = None
        self._savenow: SaveNow | None = None
        self._commands: CommandFactory | None = None
        self._serving = False
        self._ckpt_metrics: CheckpointMetrics | None = None
        self._memory: MemoryStore | None = None
        self._memory_pending = Pending()
        self._memory_jobs: set[str] = set()
        """Jobs whose memory snapshot series this replica shows (it heard of them)."""
        self._memory_metrics: MemorySnapshotMetrics | None = None

    # -- wiring -------------------------------------------------------------------------
    @property
    def catalogue(self) -> Catalogue:
        if self._catalogue is None:
            raise NotStarted(self.name)
        return self._catalogue

    @property
    def commands(self) -> CommandFactory:
        if self._commands is None:
            raise NotStarted(self.name)
        return self._commands

    @property
    def savenow(self) -> SaveNow:
        if self._savenow is None:
            raise NotStarted(self.name)
        return self._savenow

    def consumers(self) -> Sequence[Consumer]:
        s = self.settings.subjects
        return [
            Consumer(ConsumerSpec("reports", "checkpointer", (s.pattern("ckpt"),)),
                     self.on_report, (CheckpointReport,)),
            # New events only: replaying days of history into a new consumer would reopen
            # onsets that were long resolved and mark later checkpoints suspect.
            Consumer(ConsumerSpec("events", "checkpointer-events",
                                  (s.pattern("event", tail="anomaly"),
                                   s.pattern("event", tail="incident")), deliver_new=True),
                     self.on_event, (Anomaly, Incident)),
        ]

    async def start(self, rt: Runtime) -> None:
        self._catalogue = Catalogue(rt.redis, self.settings.prefix)
        self._ckpt_metrics = CheckpointMetrics(rt.metrics.registry)
        self._memory = MemoryStore(rt.redis, self._catalogue.keys, self.settings.memory_ttl)
        self._memory_metrics = MemorySnapshotMetrics(rt.metrics.registry)
        self._commands = CommandFactory(self._catalogue, self.settings)
        self._savenow = SaveNow(rt, self._catalogue, self.settings, self._commands)
        s = self.settings.subjects
        endpoints: dict[str, Callable[[str, Msg], Awaitable[bytes]]] = {
            RESUME.name: self._rpc_resume, SAVE.name: self._rpc_save,
            ROLLBACK.name: self._rpc_rollback, CATALOGUE.name: self._rpc_checkpoints,
        }
        for name, fn in endpoints.items():
            await rt.bus.nc.subscribe(s.pattern("rpc", tail=name), queue=RPC_QUEUE,
                                      cb=self._endpoint(name, fn))
        await rt.subscribe_telemetry(s.pattern("snap"), self.on_snapshot, queue=RPC_QUEUE)
        await flush(rt.bus.nc)
        self._serving = True
        rt.every(self.settings.tick, self.tick, "deadlines")
        rt.every(self.settings.tick, self.memory_tick, "memory")

    async def ready(self) -> tuple[bool, str]:
        return (True, "") if self._serving else (False, "endpoints not subscribed")

    # -- reports ------------------------------------------------------------------------
    async def on_report(self, rep: CheckpointReport, delivery: Delivery) -> None:
        self._check_report(rep, delivery.subject)
        out = await self.catalogue.record_report(rep, now=time.time(),
                                                 deadline=self.settings.commit_deadline)
        await self._mirror(out.pointer)
        if out.state == "busy":
            raise Retry(1.0, f"step {rep.step} of {rep.job} is being deleted")
        if rep.base is not None and out.state in ("pending", "complete", "failing"):
            await self.catalogue.note_base(rep.job, rep.step, rep.base)
        if out.state in ("complete", "failing"):
            await self._conclude(rep.job, rep.step, delivery)
        elif out.state == "late":
            log.bind(job=rep.job, rank=rep.rank, step=rep.step).info(
                "late report of rank %d for failed step %d of %s", rep.rank, rep.step, rep.job)

    def _check_report(self, rep: CheckpointReport, subject: str) -> None:
        parsed = self.settings.subjects.parse(subject)
        if parsed.job != rep.job or (parsed.rank is not None and parsed.rank != rep.rank):
            raise Reject(f"report of {rep.job}/rank {rep.rank} arrived on {subject}")
        if rep.world_size < 1 or not 0 <= rep.rank < rep.world_size or rep.step < 0:
            raise Reject(f"rank {rep.rank} of world size {rep.world_size} at step {rep.step} "
                         "is not a valid checkpoint report")
        path = Path(rep.path)
        if path.name != f"step-{rep.step}" or path.parent.name != rep.job:
            raise Reject(f"checkpoint path {rep.path!r} is not <root>/{rep.job}/step-{rep.step}")
        root = self.settings.checkpoint_root
        if root and not path.resolve().is_relative_to(Path(root).resolve()):
            raise Reject(f"checkpoint path {rep.path!r} is outside checkpoint_root {root!r}")

    async def _conclude(self, job: str, step: int, delivery: Delivery | None = None) -> None:
        """Verify a checkpoint every rank has reported (or one a rank failed) and close it."""
        cat = self.catalogue
        rec = await cat.record(job, step)
        if rec is None or rec.status != "pending":
            return
        reports, problems = await cat.reports(job, step)
        base = base_of(reports)
        held: tuple[str, str] | None = None
        if base is not None and not problems and len(reports) >= rec.world_size and \
                all(r.ok for r in reports.values()):
            held = await self._base_state(rec, base)
            if held is None:
                return  # the base is not judged yet: its close concludes this one
        keepalive = asyncio.create_task(self._keep_alive(delivery)) if delivery else None
        try:
            verdict = await asyncio.to_thread(
                verify_checkpoint, reports, rec.world_size, mode=self.settings.verify,
                require_metadata=self.settings.require_metadata)
        finally:
            if keepalive:
                keepalive.cancel()
        if problems:
            verdict = type(verdict)(False, "; ".join(problems), verdict.missing_ranks,
                                    verdict.bad_ranks)
        base_id = ""
        if verdict.ok and held is not None:
            base_id, why = held
            if why:
                verdict = type(verdict)(False, why, [], [])
        if verdict.ok:
            verdict = await self._write_commit_record(rec, reports, verdict, base_id)
        if verdict.ok:
            status = "committed"
            fields = {
                "bytes": str(verdict.bytes),
                "blocked": repr(max((r.seconds_blocked for r in reports.values()), default=0.0)),
                "total": repr(max((r.seconds_total for r in reports.values()), default=0.0)),
                "point": point_json(rec, saved_topology(reports)),
            }
        else:
            status = "failed"
            fields = {"reason": verdict.reason, "missing": json.dumps(verdict.missing_ranks),
                      "bad_ranks": json.dumps(verdict.bad_ranks)}
        if base is not None:
            fields["base"] = str(base)
        await self._close(rec, status, fields)

    async def _base_state(self, inc: Record, base: int) -> tuple[str, str] | None:
        """An increment commits only on a committed base: the base's id and "" when it is;
        its id and why not when it failed or went; None while it is still pending, or not
        reported yet within the increment's own deadline."""
        job, step = inc.job, inc.step
        rec = await self.catalogue.record(job, base)
        if (rec is not None and rec.status == "pending") or \
                (rec is None and time.time() < inc.deadline):
            return None
        if rec is None or rec.status != "committed" or not rec.retained:
            state = "no record" if rec is None else rec.label
            return "", f"its base, step {base}, is not committed ({state}): a restore of " \
                       f"step {step} could not read the tensors it left there"
        if rec.base is not None:
            return rec.id, f"its base, step {base}, is itself incremental"
        return rec.id, ""

    async def _conclude_dependents(self, job: str, base: int) -> None:
        """Increments that waited for ``base`` to be judged: conclude them now."""
        for rec in await self.catalogue.records(job):
            if rec.status == "pending" and rec.base == base and \
                    len(rec.report_ids) >= rec.world_size:
                await self._conclude(job, rec.step)

    async def _write_commit_record(self, rec: Record, reports: dict[int, CheckpointReport],
                                   verdict: Integrity, base_id: str = "") -> Integrity:
        """Vouch for the checkpoint on disk before the pointer names it: ranks open a resume
        point only where this record matches. A record that cannot be written fails it."""
        try:
            await asyncio.to_thread(write_commit, commit_record(rec, reports, base_id))
        except OSError as exc:
            return type(verdict)(False, f"cannot write the commit record: {exc}", [], [])
        return verdict

    async def _close(self, rec: Record, status: str, fields: dict[str, str]) -> None:
        now = time.time()
        out = await self.catalogue.close(rec, status, fields, now=now)
        if not out.won:
            return
        if self._ckpt_metrics is not None:
            self._ckpt_metrics.closed_checkpoint(
                rec.job, rec.step, "suspect" if out.suspect and status == "committed"
                else status, rec.t0 or rec.first_at, now)
        log.bind(job=rec.job, step=rec.step).info(
            "checkpoint %s step %d: %s%s", rec.job, rec.step, status,
            f" ({fields.get('reason') or out.suspect})" if fields.get("reason") or out.suspect
            else "")
        await self._mirror(out.pointer)
        await self._announce(rec.job, rec.step)
        if "base" not in fields:  # a full checkpoint: increments may wait on it
            await self._conclude_dependents(rec.job, rec.step)
        if status == "committed":
            try:
                await self._retain(rec.job)
                await self._evaluate_interval(rec.job)
            except Exception:
                log.bind(job=rec.job).exception("after-commit work for %s failed", rec.job)

    @staticmethod
    async def _keep_alive(delivery: Delivery) -> None:
        """A full verification can outlast the ack wait: keep the message ours meanwhile."""
        while True:
            await asyncio.sleep(10.0)
            with contextlib.suppress(Exception):
                await delivery.in_progress()

    # -- timers -------------------------------------------------------------------------
    async def tick(self) -> None:
        """Fail checkpoints whose deadline passed; retry events that did not go out."""
        cat = self.catalogue
        now = time.time()
        for job, step in await cat.due(now):
            rec = await cat.record(job, step)
            if rec is None or rec.status != "pending":
                await cat.forget_deadline(job, step)
                continue
            if rec.deadline > now:
                continue
            if len(rec.report_ids) >= rec.world_size:
                await self._conclude(job, step)
                continue
            missing = rec.missing()
            reason = (f"no report from ranks {missing} within {self.settings.commit_deadline:g}s "
                      f"of the first (reported: {rec.reported})")
            await self._close(rec, "failed", {"reason": reason, "missing": json.dumps(missing),
                                              "bad_ranks": "[]"})
        for job, step in await cat.queued_announcements():
            await self._announce(job, step)

    # -- memory snapshots ---------------------------------------------------------------
    def on_snapshot(self, msg: TelemetryMessage, subject: str) -> None:
        """A rank's newest verified memory snapshot: noted, written on the next tick."""
        if isinstance(msg, SnapshotReport):
            self._memory_pending.note(msg, time.time())

    async def memory_tick(self) -> None:
        """Write the reports noted since the last tick; refresh the series of every job
        this replica heard of (the age grows while no rank reports)."""
        store, metrics = self._memory, self._memory_metrics
        if store is None or metrics is None:
            return
        self._memory_jobs |= await store.write(self._memory_pending.take())
        now = time.time()
        for job in list(self._memory_jobs):
            summary = await store.summary(job, now)
            metrics.show(job, summary)
            if summary is None:
                self._memory_jobs.discard(job)

    # -- events out ---------------------------------------------------------------------
    async def _announce(self, job: str, step: int) -> None:
        """Publish the record's current state once (the outbox entry is the claim)."""
        cat = self.catalogue
        if not await cat.claim_announcement(job, step):
            return
        rec = await cat.record(job, step)
        if rec is None or rec.status not in ("committed", "failed"):
            return
        status: Literal["committed", "failed", "suspect"] = \
            "failed" if rec.status == "failed" else "suspect" if rec.suspect else "committed"
        event = CheckpointCommitted(
            id=rec.id, job=job, step=step, path=rec.path, status=status,
            world_size=rec.world_size, bytes=rec.bytes, missing_ranks=rec.missing_ranks,
            reason=rec.suspect if status == "suspect" else rec.reason, time=time.time())
        try:
            await self.runtime.publish_event(self.settings.subjects.event(job, "checkpoint"),
                                             event)
        except Exception as exc:
            log.bind(job=job, step=step).warning(
                "publishing checkpoint event of %s step %d failed (%r); will retry", job, step,
                exc)
            await cat.requeue_announcement(job, step)

    async def _mirror(self, change: PointerChange) -> None:
        """Keep LATEST equal to the pointer in Redis."""
        if not change.changed:
            return
        try:
            if change.new:
                await asyncio.to_thread(write_latest, change.new)
            elif change.old:
                await asyncio.to_thread(remove_latest, change.old)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("could not update LATEST (%r); the Redis pointer stays authoritative",
                        exc)

    # -- retention and interval ---------------------------------------------------------
    async def _retain(self, job: str) -> None:
        cat = self.catalogue
        records = await cat.records(job)
        pointer = await cat.pointer(job)
        pointer_step = msgspec.json.decode(pointer.encode(), type=ResumePoint).step \
            if pointer else None
        entries = [Entry(r.step, r.status, bool(r.suspect), r.retained, r.base)
                   for r in records]
        steps = expire(entries, self.settings.retain, pointer=pointer_step, pin=await cat.pin(job),
                       include_expired=self.settings.delete_files)
        expired = await cat.expire(job, steps, delete=self.settings.delete_files)
        by_step = {r.step: r for r in records}
        for step in expired if self.settings.delete_files else ():
            path = Path(by_step[step].path)
            if path.name == f"step-{step}" and path.parent.name == job:
                await asyncio.to_thread(shutil.rmtree, path, True)
            await cat.mark_deleted(job, step)
        if expired:
            log.bind(job=job).info("retention of %s: %s steps %s", job,
                                   "deleted" if self.settings.delete_files else "expired",
                                   expired)
        await cat.prune(job, self.settings.catalogue_limit)

    async def _evaluate_interval(self, job: str) -> None:
        cat = self.catalogue
        progress = await self.commands.progress(job)
        if progress is None or not progress.median_step_time:
            return
        recent = [r.seconds_blocked for r in await cat.records(job)
                  if r.status == "committed"][: self.settings.interval_window]
        failures, since = await cat.failure_count(job)
        current = await cat.interval(job)
        now = time.time()
        decision = self.policy.decide(
            blocked=recent, failures=failures, observed=now - since if since else 0.0,
            step_time=progress.median_step_time,
            current_steps=int(current["every_steps"]) if current else None)
        if decision is None or not decision.publish:
            return
        cmd = await self.commands.build(job, "set_interval",
                                        {"every_steps": decision.every_steps})
        await self.runtime.publish_event(self.settings.subjects.cmd_all(job), cmd)
        await cat.set_interval(job, {
            "every_steps": decision.every_steps, "from_step": cmd.params.get("from_step"),
            "seconds": decision.seconds, "raw_seconds": decision.raw_seconds,
            "cost": decision.cost, "mtbf": decision.mtbf, "failures": decision.failures,
            "step_time": progress.median_step_time, "command_id": cmd.id, "time": now})
        log.bind(job=job).info(
            "interval of %s: every %d steps (%.0fs; C=%.3fs, MTBF=%.0fs, %d failures)", job,
            decision.every_steps, decision.seconds, decision.cost, decision.mtbf,
            decision.failures)

    # -- events in ----------------------------------------------------------------------
    async def on_event(self, event: Anomaly | Incident, delivery: Delivery) -> None:
        cat = self.catalogue
        now = time.time()
        if isinstance(event, Incident):
            if await cat.add_failure(event.job, event.id, incident=True, now=now):
                await self._evaluate_interval(event.job)
            return
        if event.kind in self.settings.suspect_kind_set:
            if event.status == "open":
                out = await cat.open_onset(event.job, event.id, event.kind, event.step,
                                           event.onset_at)
                await self._mirror(out.pointer)
                for s in out.suspect_steps:
                    await self._announce(event.job, s)
            else:
                await cat.close_onset(event.job, event.id)
        if event.kind in self.settings.failure_kind_set and event.status == "open" \
                and await cat.add_failure(event.job, event.id, incident=False, now=now):
            await self._evaluate_interval(event.job)

    # -- request/reply ------------------------------------------------------------------
    def _endpoint(self, name: str, fn: Callable[[str, Msg], Awaitable[bytes]]
                  ) -> Callable[[Msg], Awaitable[None]]:
        """Each request runs in a task of its own: a save-now waits up to its deadline and
        must not hold up other requests (callbacks of one subscription run one at a time).
        A request that fails is answered with the error and counted; the endpoint goes on."""
        consumer = f"rpc:{name}"

        async def _serve(msg: Msg) -> None:
            job = self.settings.subjects.job_of(msg.subject)
            if job is None:
                return
            try:
                data = await fn(job, msg)
            except Exception as exc:
                self.runtime.metrics.error(consumer, "callback_error")
                log.bind(job=job).exception("rpc %s for %s failed", name, job)
                reason = f"coordinator error: {type(exc).__name__}: {exc}"
                data = error_reply(name, job, reason)
            if msg.reply:
                with contextlib.suppress(Exception):
                    await msg.respond(data)

        async def _cb(msg: Msg) -> None:
            self.runtime.spawn(_serve(msg), consumer)

        return self.runtime.isolate(_cb, consumer)

    async def _rpc_resume(self, job: str, msg: Msg) -> bytes:
        try:
            req = RESUME.decode_request(msg.data) if msg.data else ResumeRequest()
        except DecodeError:
            req = ResumeRequest()
        if req.below_step is not None:  # a rank could not load the pointer's checkpoint
            rec = await self.catalogue.newest_good_below(job, req.below_step)
            log.bind(job=job).warning(
                "rank %s could not load the checkpoint at step %d or later: offering %s",
                req.rank, req.below_step, f"step {rec.step}" if rec else "nothing older")
            if rec is None:
                return b""
            await self._backfill_commit(job, decode_durable(rec.point.encode(), ResumePoint))
            return rec.point.encode()
        point = await self.catalogue.pointer(job)
        if point:
            await self._backfill_commit(job, decode_durable(point.encode(), ResumePoint))
        return point.encode() if point else b""

    async def _backfill_commit(self, job: str, point: ResumePoint) -> None:
        """A checkpoint committed before commit records existed gets one when a rank asks
        for it, from the reports the catalogue kept (ranks refuse a resume point without)."""
        if (Path(point.path) / COMMIT_FILE).exists():
            return
        rec = await self.catalogue.record(job, point.step)
        if rec is None or rec.status != "committed":
            return
        reports, _ = await self.catalogue.reports(job, point.step)
        base = await self.catalogue.record(job, rec.base) if rec.base is not None else None
        with contextlib.suppress(OSError):
            await asyncio.to_thread(write_commit, commit_record(rec, reports,
                                                                base.id if base else ""))

    async def _rpc_save(self, job: str, msg: Msg) -> bytes:
        try:
            req = SAVE.decode_request(msg.data)
        except DecodeError as exc:
            return SAVE.encode_reply(SaveReply(ok=False, job=job, status="bad_request",
                                               reason=exc.reason))
        return SAVE.encode_reply(await self.savenow.request(job, req))

    async def _rpc_rollback(self, job: str, msg: Msg) -> bytes:
        try:
            req = ROLLBACK.decode_request(msg.data)
        except DecodeError as exc:
            return ROLLBACK.encode_reply(RollbackReply(ok=False, job=job, reason=exc.reason))
        why = f"rolled back below step {req.below_step}" + (f": {req.reason}" if req.reason
                                                              else "")
        out = await self.catalogue.rollback(job, req.below_step, now=time.time(), reason=why)
        await self._mirror(out.pointer)
        for s in out.suspect_steps:
            await self._announce(job, s)
        if not out.pointer.new:
            memory = await self._memory.summary(job) if self._memory is not None else None
            if memory is not None and memory.oldest_step < req.below_step:
                newest = min(memory.newest_step, req.below_step - 1)
                log.bind(job=job).info("rollback of %s below step %d: no checkpoint on disk; "
                                       "memory snapshots from step %d", job, req.below_step,
                                       memory.oldest_step)
                return ROLLBACK.encode_reply(RollbackReply(
                    ok=False, job=job, suspect_steps=out.suspect_steps, memory_step=newest,
                    reason=f"no committed, non-suspect checkpoint below step "
                           f"{req.below_step}; every rank holds memory snapshots of steps "
                           f"{memory.oldest_step}..{newest}: a reload in place from memory"))
            return ROLLBACK.encode_reply(RollbackReply(
                ok=False, job=job, suspect_steps=out.suspect_steps,
                reason=f"no committed, non-suspect checkpoint below step {req.below_step}: "
                       "a restart starts from scratch"))
        point = decode_durable(out.pointer.new.encode(), ResumePoint)
        log.bind(job=job).info("rollback of %s below step %d: pointer at step %d", job,
                               req.below_step, point.step)
        return ROLLBACK.encode_reply(RollbackReply(ok=True, job=job, point=point, step=point.step,
                                    suspect_steps=out.suspect_steps))

    async def _rpc_checkpoints(self, job: str, msg: Msg) -> bytes:
        try:
            req = CATALOGUE.decode_request(msg.data)
        except DecodeError:
            req = CatalogueRequest()
        cat = self.catalogue
        pointer = await cat.pointer(job)
        point = None
        if pointer:
            with contextlib.suppress(DecodeError):
                point = decode_durable(pointer.encode(), ResumePoint)
        records = await cat.records(job, max(1, req.limit))
        memory = await self._memory.summary(job) if self._memory is not None else None
        return CATALOGUE.encode_reply(CatalogueReply(
            job=job, pointer=point, pin=await cat.pin(job), interval=await cat.interval(job),
            onsets=await cat.onsets(job), checkpoints=[r.summary() for r in records],
            memory=memory))
