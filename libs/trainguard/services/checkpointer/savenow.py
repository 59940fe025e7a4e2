"""save-now: broadcast ``save_now``, wait for the commit up to a deadline, answer.

The requester (the remediator before a restart, ``trainguard save``, the agent on
preemption) gets the committed step or why there is none, naming the ranks that did not
report. Acks steer the wait: ``done`` acks tell the step of a ``seq`` command
(``step=<S>`` in their detail), ``too_late`` acks make the coordinator re-send with a later
``at_step``. Two requests for one job at once share one save.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from dataclasses import dataclass, field
from typing import Any

from nats.aio.msg import Msg

from trainguard.contract.codec import decode_durable
from trainguard.contract.errors import DecodeError
from trainguard.contract.rpc import SaveReply, SaveRequest
from trainguard.contract.schemas import CheckpointCommitted, Command, CommandAck
from trainguard.core.connection import flush
from trainguard.runtime.logs import get_logger
from trainguard.runtime.service import Runtime

from .blockers import blocking_ranks, describe
from .catalogue import Catalogue
from .commands import ISSUER, CommandFactory
from .records import Record
from .settings import CheckpointerSettings

log = get_logger("trainguard.checkpointer")

_STEP_IN_DETAIL = re.compile(r"\bstep=(\d+)")
_DONE_STEP = re.compile(r"step (\d+) done")
_CLOSED = ("committed", "failed", "deleting", "deleted")


@dataclass
class _Wait:
    """What one save-now has learned so far."""

    ids: dict[str, Command] = field(default_factory=dict)
    step: int | None = None
    already_saved: bool = False
    done: dict[str, str] = field(default_factory=dict)
    """responder -> ack detail, for the command of the current ``step``."""
    failed: dict[str, str] = field(default_factory=dict)
    retried: set[str] = field(default_factory=set)
    retries: int = 0

    def command_ids(self) -> list[str]:
        return list(self.ids)


class SaveNow:
    def __init__(self, rt: Runtime, catalogue: Catalogue, settings: CheckpointerSettings,
                 commands: CommandFactory) -> None:
        self.rt = rt
        self.catalogue = catalogue
        self.settings = settings
        self.commands = commands
        self._inflight: dict[str, asyncio.Future[SaveReply]] = {}

    async def request(self, job: str, req: SaveRequest) -> SaveReply:
        """Run one save-now for ``job``, or join the one already running."""
        running = self._inflight.get(job)
        if running is not None:
            return await asyncio.shield(running)
        fut: asyncio.Future[SaveReply] = asyncio.get_running_loop().create_future()
        self._inflight[job] = fut
        started = time.monotonic()
        try:
            reply = await self._run(job, req, started)
        except Exception as exc:
            log.bind(job=job).exception("save-now for %s failed", job)
            reply = SaveReply(ok=False, job=job, status="error", reason=f"coordinator error: "
                              f"{type(exc).__name__}: {exc}",
                              elapsed=time.monotonic() - started)
        finally:
            self._inflight.pop(job, None)
        fut.set_result(reply)
        return reply

    async def _run(self, job: str, req: SaveRequest, started: float) -> SaveReply:
        deadline = req.deadline if req.deadline and req.deadline > 0 \
            else self.settings.save_deadline
        end = started + deadline
        issued = time.time()
        subjects = self.rt.bus.subjects
        inbox: asyncio.Queue[CommandAck | CheckpointCommitted] = asyncio.Queue()

        async def on_ack(msg: Msg) -> None:
            with contextlib.suppress(DecodeError):
                inbox.put_nowait(decode_durable(msg.data, CommandAck))

        async def on_event(msg: Msg) -> None:
            with contextlib.suppress(DecodeError):
                inbox.put_nowait(decode_durable(msg.data, CheckpointCommitted))

        nc = self.rt.bus.nc
        subs = [await nc.subscribe(subjects.ack(job, ISSUER), cb=on_ack),
                await nc.subscribe(subjects.event(job, "checkpoint"), cb=on_event)]
        wait = _Wait()
        try:
            await flush(nc)
            params: dict[str, Any] = {"reason": req.reason} if req.reason else {}
            if req.blocking:
                params["blocking"] = True
            await self._send(job, wait, params, end, after_step=None, retry_of=None)
            while (remaining := end - time.monotonic()) > 0:
                rec = await self.catalogue.record(job, wait.step) \
                    if wait.step is not None else None
                if rec is not None and rec.status in _CLOSED and \
                        (wait.already_saved or rec.first_at >= issued - 1.0):
                    return self._closed(job, rec, wait, started)
                reported = set(rec.reported) if rec is not None and \
                    rec.first_at >= issued - 1.0 else set()
                blockers = blocking_ranks(await self.commands.progress(job), reported)
                if blockers:
                    return self._abandoned(job, wait, blockers, started)
                try:
                    item = await asyncio.wait_for(inbox.get(), min(remaining, 0.5))
                except TimeoutError:
                    continue
                if isinstance(item, CommandAck) and item.command_id in wait.ids:
                    await self._on_ack(job, wait, item, params, end)
        finally:
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        return await self._timeout(job, wait, deadline, started)

    async def _send(self, job: str, wait: _Wait, params: dict[str, Any], end: float, *,
                    after_step: int | None, retry_of: str | None) -> Command:
        cmd = await self.commands.build(job, "save_now", params, after_step=after_step,
                                        retry_of=retry_of,
                                        deadline=max(0.0, end - time.monotonic()))
        wait.ids[cmd.id] = cmd
        if cmd.at_step is not None:
            wait.step = cmd.at_step
            wait.done.clear()
        await self.rt.publish_event(self.rt.bus.subjects.cmd_all(job), cmd)
        log.bind(job=job, step=cmd.at_step).info(
            "save_now %s for %s: %s", cmd.id, job,
            f"at_step {cmd.at_step}" if cmd.at_step is not None else f"seq {cmd.seq}")
        return cmd

    async def _on_ack(self, job: str, wait: _Wait, ack: CommandAck, params: dict[str, Any],
                      end: float) -> None:
        cmd = wait.ids[ack.command_id]
        if ack.outcome == "done":
            m = _STEP_IN_DETAIL.search(ack.detail)
            if m and (cmd.at_step is None or int(m.group(1)) == cmd.at_step):
                if wait.step is None:
                    wait.step = int(m.group(1))
                wait.already_saved = wait.already_saved or "already saved" in ack.detail
            wait.done[ack.responder] = ack.detail
            wait.failed.pop(ack.responder, None)
        elif ack.outcome == "too_late":
            if cmd.id in wait.retried or wait.retries >= self.settings.save_retries:
                wait.failed[ack.responder] = f"too late: {ack.detail}"
                return
            wait.retried.add(cmd.id)
            wait.retries += 1
            m = _DONE_STEP.search(ack.detail)
            after = max(int(m.group(1)) if m else -1, cmd.at_step or -1)
            # A retry of a command some rank already ran would not run again there: only a
            # command nobody ran may be a retry_of; otherwise send a fresh one.
            retry_of = cmd.id if not wait.done else None
            await self._send(job, wait, params, end, after_step=after, retry_of=retry_of)
        else:
            wait.failed[ack.responder] = f"{ack.outcome}: {ack.detail}"

    def _abandoned(self, job: str, wait: _Wait, blockers: dict[int, str],
                   started: float) -> SaveReply:
        elapsed = time.monotonic() - started
        reason = (f"abandoned after {elapsed:.1f}s: {describe(blockers)}; a collective save "
                  "cannot complete without them")
        log.bind(job=job, step=wait.step).warning("save_now for %s %s", job, reason)
        return SaveReply(ok=False, job=job, status="abandoned", step=wait.step, reason=reason,
                         missing_ranks=list(blockers), command_ids=wait.command_ids(),
                         elapsed=elapsed)

    def _closed(self, job: str, rec: Record, wait: _Wait, started: float) -> SaveReply:
        elapsed = time.monotonic() - started
        common: dict[str, Any] = {"job": job, "step": rec.step, "path": rec.path,
                                  "checkpoint_id": rec.id, "command_ids": wait.command_ids(),
                                  "elapsed": elapsed}
        if rec.status == "committed" and not rec.suspect:
            return SaveReply(ok=True, status="committed", **common)
        if rec.status == "committed":
            return SaveReply(ok=False, status="suspect",
                             reason=f"committed but suspect: {rec.suspect}", **common)
        if rec.status in ("deleting", "deleted"):
            return SaveReply(ok=False, status="failed",
                             reason="the checkpoint was deleted by retention", **common)
        return SaveReply(ok=False, status="failed", reason=rec.reason,
                         missing_ranks=rec.missing_ranks, failed_ranks=rec.bad_ranks, **common)

    async def _timeout(self, job: str, wait: _Wait, deadline: float,
                       started: float) -> SaveReply:
        elapsed = time.monotonic() - started
        rec = await self.catalogue.record(job, wait.step) if wait.step is not None else None
        failed = sorted(int(r.split("-", 1)[1]) for r in wait.failed
                        if r.startswith("rank-") and r[5:].isdigit())
        notes = "; ".join(f"{who}: {why}" for who, why in sorted(wait.failed.items()))
        notes = f" ({notes})" if notes else ""
        if rec is not None and rec.status == "pending":
            missing = rec.missing()
            reason = (f"step {rec.step} not committed within {deadline:g}s: ranks {missing} "
                      f"did not report (reported: {rec.reported}){notes}")
        elif wait.step is not None:
            progress = await self.commands.progress(job)
            world = progress.world_size if progress and progress.world_size else 0
            acked = {int(r[5:]) for r in wait.done if r.startswith("rank-") and r[5:].isdigit()}
            missing = [r for r in range(world) if r not in acked]
            reason = (f"no rank reported step {wait.step} within {deadline:g}s"
                      + (f"; ranks {missing} did not acknowledge" if missing else "") + notes)
        else:
            missing = []
            reason = f"no rank acknowledged save_now within {deadline:g}s{notes}"
        return SaveReply(ok=False, job=job, status="timeout", step=wait.step,
                         path=rec.path if rec else "", checkpoint_id=rec.id if rec else "",
                         reason=reason, missing_ranks=missing, failed_ranks=failed,
                         command_ids=wait.command_ids(), elapsed=elapsed)
