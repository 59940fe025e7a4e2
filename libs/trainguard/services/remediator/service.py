"""The remediator's async shell: diagnoses in; commands, incidents and actions out.

Every decision (which incident a diagnosis joins, its plan, the next step, what the acks
mean, whether the launcher already restarted) is a pure function in :mod:`.engine`, and
when an incident ends or its job must be held in :mod:`.endings`; this module counts the
launcher's attempts from worker exits, keeps the node records from the agents' hellos,
loads and saves incidents, sends commands (:func:`trainguard.contract.targets.addressed`), calls
the checkpoint coordinator (:mod:`trainguard.contract.rpc`) and waits.

Only the leader acts (:mod:`.leader`); other replicas ``nak`` diagnoses with a delay.
Incidents and their plans live in Redis (fenced writes), so a new leader resumes open
incidents where the old one stopped: steps already acknowledged are not run again, and a
step that was sent but not acknowledged is re-sent as a retry (``retry_of``), which agents
answer without running it twice. One writer at a time per incident (a lock around each
load, change and save): a diagnosis that would join an incident while one of its steps
runs is redelivered after the step, so neither overwrites the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from opentelemetry.context import Context

from trainguard.contract.codec import decode_as
from trainguard.contract.envelope import H_TYPE, normalize_headers
from trainguard.contract.errors import Retry
from trainguard.contract.schemas import (
    Anomaly,
    CommandAck,
    Diagnosis,
    HookRun,
    Incident,
    IncidentStep,
    NodeHello,
    RankHello,
    RecoveryReport,
    WorkerExit,
)
from trainguard.contract.targets import addressed
from trainguard.runtime.fencing import Epochs
from trainguard.runtime.jobmetrics import IncidentMetrics
from trainguard.runtime.logs import get_logger
from trainguard.runtime.service import TRANSIENT_ERRORS, Consumer, Delivery, Runtime, Service
from trainguard.runtime.state import Keys
from trainguard.runtime.topology import ConsumerSpec

from . import endings, hooks, recovery
from . import engine as rules
from .acks import AckBox
from .coordinator import Coordinator
from .hooks import Hook
from .leader import Leadership, NotLeader
from .policy import Policy, load_policy
from .settings import RemediatorSettings
from .store import Store

log = get_logger("trainguard.remediator")

TRANSIENT_PAUSE_S, TRANSIENT_PAUSE_MAX_S = 0.5, 5.0
"""Backoff of an incident whose step met Redis or JetStream away."""

Persist = Callable[[], Awaitable[None]]
"""Saves the incident before a command goes out: a successor must know it was sent."""


class RemediatorService(Service[RemediatorSettings]):
    name = "remediator"
    settings_type = RemediatorSettings

    def __init__(self, settings: RemediatorSettings) -> None:
        super().__init__(settings)
        self.policy: Policy = load_policy(settings.policy or None)
        self.isolate_hook = Hook.parse("isolate_hook", settings.isolate_hook)
        self.release_hook = Hook.parse("release_hook", settings.release_hook)
        self.keys = Keys(settings.prefix)
        self.leader: Leadership | None = None
        self._store: Store | None = None
        self._coordinator: Coordinator | None = None
        self._acks = AckBox()
        self._running: dict[str, asyncio.Task[None]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._resolved_anomalies: set[str] = set()
        self._metrics: IncidentMetrics | None = None
        self._counted: dict[str, None] = {}
        """Incidents whose end is counted (insertion-ordered, bounded)."""

    # -- wiring ---------------------------------------------------------------------------
    def consumers(self) -> Sequence[Consumer]:
        s = self.settings.subjects
        return [
            Consumer(ConsumerSpec("events", "remediator",
                                  (s.pattern("event", tail="diagnosis"),), ack_wait=60.0),
                     self.on_diagnosis, (Diagnosis,)),
            Consumer(ConsumerSpec("events", "remediator-anomalies",
                                  (s.pattern("event", tail="anomaly"),)),
                     self.on_anomaly, (Anomaly,)),
            Consumer(ConsumerSpec("reports", "remediator-exits", (s.pattern("exit"),)),
                     self.on_exit, (WorkerExit,)),
            # A subject filter's wildcard is a whole token (``host-*`` is a literal), so the
            # consumer takes every hello and leaves the ranks' to the detector.
            Consumer(ConsumerSpec("reports", "remediator-nodes", (s.pattern("reg"),)),
                     self.on_hello, (NodeHello, RankHello)),
            Consumer(ConsumerSpec("reports", "remediator-recovery", (s.pattern("recovery"),)),
                     self.on_recovery, (RecoveryReport,)),
        ]

    async def start(self, rt: Runtime) -> None:
        epochs = Epochs(rt.bus.js, self.settings.prefix, self.settings.stream_replicas)
        self.leader = Leadership(rt.redis, self.keys, epochs, ttl=self.settings.lease_ttl)
        self._metrics = IncidentMetrics(rt.metrics.registry, "remediator")
        self._store = Store(rt.redis, self.keys, self.leader)
        self._coordinator = Coordinator(rt.bus.nc, self.settings.subjects)
        await rt.subscribe(self.settings.subjects.pattern("ack", tail="remediator"),
                           self._on_ack, consumer="acks")
        rt.every(self.settings.lease_ttl / 4, self._lead, "leadership")
        rt.every(1.0, self._watch, "resolution")
        rt.every(self.settings.blocklist_sweep, self._sweep_blocklist, "blocklist")

    async def stop(self) -> None:
        for task in self._running.values():
            task.cancel()
        if self.leader is not None:
            with contextlib.suppress(Exception):
                await self.leader.release()

    @property
    def store(self) -> Store:
        assert self._store is not None, "remediator not started"
        return self._store

    @property
    def coordinator(self) -> Coordinator:
        assert self._coordinator is not None, "remediator not started"
        return self._coordinator

    async def ready(self) -> tuple[bool, str]:
        role = "leader" if self.leader and self.leader.leading else "standby"
        return True, f"ready ({role})"

    async def _lead(self) -> None:
        assert self.leader is not None
        was = self.leader.leading
        leading = await self.leader.tick()
        if self._metrics is not None:
            self._metrics.leading(leading)
        if leading and not was:
            log.info("remediator: leading with epoch %d", self.leader.epoch)
            for inc in await self.store.open_all():
                log.bind(job=inc.job, incident=inc.id).info("resuming incident %s of %s",
                                                            inc.id, inc.job)
                self._run(inc)

    # -- inputs ---------------------------------------------------------------------------
    async def _on_ack(self, msg: Any) -> None:
        """A malformed ack raises DecodeError: the runtime dead-letters and counts it."""
        self._acks.add(decode_as(msg.data, normalize_headers(msg.headers).get(H_TYPE),
                                 CommandAck))

    async def on_anomaly(self, a: Anomaly, delivery: Delivery) -> None:
        if a.status == "resolved":
            self._resolved_anomalies.add(a.id)

    async def on_exit(self, ex: WorkerExit, delivery: Delivery) -> None:
        """Count the launcher's own restarts against the budget (any replica: the count is
        idempotent); :meth:`_watch` holds the job once they pass it."""
        attempt = endings.ended_attempt(ex, time.time())
        if attempt is not None:
            await self.store.note_attempt(ex.job, attempt, ex.time or time.time(),
                                          ex.generation)

    async def on_recovery(self, report: RecoveryReport, delivery: Delivery) -> None:
        """Keep a rank's or agent's account of a recovery (any replica: keyed by its id);
        the leader's incidents read it (:mod:`.recovery`) as they wait and resolve."""
        await self.store.note_recovery(report)

    async def on_hello(self, hello: NodeHello | RankHello, delivery: Delivery) -> None:
        """Keep the host's node record from its agent's durable hellos (any replica: the
        write is a compare-and-set on the hello's time); agents never write Redis."""
        if isinstance(hello, NodeHello):
            await self.store.record_node(hello)

    async def on_diagnosis(self, d: Diagnosis, delivery: Delivery) -> None:
        assert self.leader is not None
        if not self.leader.leading:
            raise Retry(delay=1.0, reason="not the leader")
        now = time.time()
        found = rules.find_incident(await self.store.of(d.job), d, self.policy.cooldown_s, now)
        if found is None:
            await self._decide(d, None, now, delivery.ctx)
            return
        lock = self._lock(found.id)
        if lock.locked():
            raise Retry(delay=1.0, reason=f"incident {found.id} is running a step")
        async with lock:  # join what its last step saved, if it still takes this diagnosis
            fresh = await self.store.load(d.job, found.id)
            joins = rules.find_incident([fresh] if fresh else [], d, self.policy.cooldown_s,
                                        now)
            await self._decide(d, joins, now, delivery.ctx)

    async def _decide(self, d: Diagnosis, inc: Incident | None, now: float,
                      ctx: Context | None) -> None:
        """Open an incident for ``d``, or join ``d`` to ``inc`` (re-planning it if its root
        cause changed); then run its steps. ``ctx``: the diagnosis' trace."""
        with self.runtime.tracer.start_as_current_span(
            f"decide {d.cause}", context=ctx, attributes={
                "trainguard.job": d.job, "trainguard.cause": d.cause,
                "trainguard.hosts": ",".join(d.hosts),
                "trainguard.ranks": ",".join(map(str, d.ranks))},
        ):
            if inc is None:
                if d.status == "superseded":
                    return  # its successor carries the story
                inc = rules.open_incident(d, rules.detected_at(d, now), now)
                inc.failure_attempt = (await self.store.view(d.job, d.cause)).attempt
                replan = True
            else:
                replan = rules.join(inc, d) and rules.is_open(inc)
            if d.status == "open":
                await self.store.note_cause(d, now)  # once per diagnosis: a recurrence
            endings.sign(inc, d)
            if replan:
                rules.replan(inc, d, self.policy, await self.store.view(d.job, inc.cause), now)
            await self._save(inc)
            self._run(inc)

    # -- incidents ------------------------------------------------------------------------
    async def _save(self, inc: Incident, *, publish: bool = True) -> None:
        """Persist ``inc`` (fenced); ``publish``: a new revision for the event stream."""
        if publish:
            inc.rev += 1
        await self.store.save(inc)
        if not rules.is_open(inc) and self._metrics is not None and inc.id not in self._counted:
            self._metrics.ended_incident(inc)
            self._counted[inc.id] = None
            if len(self._counted) > 10_000:
                del self._counted[next(iter(self._counted))]
        if publish:
            await self.runtime.publish_event(self.settings.subjects.event(inc.job, "incident"), inc)

    def _lock(self, ident: str) -> asyncio.Lock:
        return self._locks.setdefault(ident, asyncio.Lock())

    def _run(self, inc: Incident) -> None:
        task = self._running.get(inc.id)
        if task is not None and not task.done():
            return
        self._running[inc.id] = self.runtime.spawn(self._execute(inc.id, inc.job),
                                              f"incident:{inc.id}")

    async def _execute(self, ident: str, job: str) -> None:
        """Run the incident's pending steps in order, persisting after each.

        A transient failure (Redis or JetStream away longer than their own retries) pauses
        the incident, never ends its task: the loop reloads it and goes on from what was
        saved, so a step already persisted as done is not run again.
        """
        assert self.leader is not None
        pause = TRANSIENT_PAUSE_S
        try:
            while self.leader.leading:
                try:
                    grace, index, inc = await self._step(ident, job)
                except TRANSIENT_ERRORS as exc:
                    log.bind(job=job, incident=ident).warning(
                        "incident %s paused %.1fs: %r", ident, pause, exc)
                    await asyncio.sleep(pause)
                    pause = min(TRANSIENT_PAUSE_MAX_S, pause * 2)
                    continue
                pause = TRANSIENT_PAUSE_S
                if inc is None:
                    return
                if not grace:
                    continue
                # Unlocked: a better diagnosis (superseding this guess) may re-plan meanwhile.
                await asyncio.sleep(grace)
                async with self._lock(ident):
                    fresh = await self.store.load(job, ident)
                    if fresh is not None and fresh.actions == inc.actions:
                        fresh.actions[index].params["waited"] = True
                        await self._save(fresh, publish=False)
                # re-planned meanwhile, or waited: the loop runs what is planned now
        except NotLeader:
            log.warning("lost leadership during incident %s", ident)

    async def _step(self, ident: str, job: str) -> tuple[float, int, Incident | None]:
        """Run the incident's next step, or say how long its grace still is.

        Returns ``(grace, index, incident)``: grace 0 after a step ran; the incident None
        when there is nothing more to run (ended, or concluded now).
        """
        async with self._lock(ident):
            inc = await self.store.load(job, ident)
            if inc is None or not rules.is_open(inc):
                return 0.0, -1, None
            index = rules.next_step(inc)
            if index is None:
                if rules.conclude(inc, time.time()):
                    await self._save(inc)
                return 0.0, -1, None
            step = inc.actions[index]
            grace = rules.grace_to_wait(step)
            if grace:
                return grace, index, inc
            rules.start_step(inc, step, time.time())
            await self._do(inc, step, functools.partial(self._save, inc, publish=False))
            rules.finish_step(inc, step)
            # Saved before it is announced: a publish that fails now cannot run it again.
            await self._save(inc)
            await self.runtime.publish_event(self.settings.subjects.event(inc.job, "action"),
                                             rules.action_event(inc, step, time.time()))
            return 0.0, index, inc

    async def _do(self, inc: Incident, step: IncidentStep, persist: Persist) -> None:
        with self.runtime.tracer.start_as_current_span(
            f"act {step.action}", attributes={"trainguard.job": inc.job,
                                              "trainguard.incident": inc.id,
                                              "trainguard.cause": inc.cause,
                                              "trainguard.action": step.action},
        ) as span:
            try:
                await self._dispatch(inc, step, persist)
            except NotLeader:
                raise
            except TRANSIENT_ERRORS:
                raise  # not the step's failure: the executor pauses and runs it again
            except Exception as exc:  # any other failure of a step escalates its incident
                step.status, step.detail = "failed", f"{type(exc).__name__}: {exc}"
            span.set_attribute("trainguard.outcome", step.status)

    async def _dispatch(self, inc: Incident, step: IncidentStep, persist: Persist) -> None:
        assert self.leader is not None
        match step.action:
            case "alert":
                step.status, step.detail = "done", f"alert: {inc.summary}"
            case "escalate":
                step.status = "done"
                step.detail = str(step.params.get("reason", "escalated to a human"))
            case "save_now":
                step.status, step.detail = await self.coordinator.save(
                    inc.job, float(step.params.get("deadline", 60)))
            case "rollback":
                reply, (step.status, step.detail) = await self.coordinator.rollback_to(
                    inc.job, int(step.params.get("below_step", 0)))
                if step.status == "done" and reply is not None and reply.step is not None:
                    await self._reload(inc, step, reply.step,
                                       reply.point.path if reply.point is not None else "")
            case "dump":
                host = str(step.params["host"])
                await self._command(inc, step, "dump", [host], persist, host=host,
                                    params={"ranks": step.params.get("ranks")})
            case "isolate":
                host = str(step.params["host"])
                await self.store.block(host, rules.blocklist_entry(
                    inc, time.time(), self.settings.blocklist_ttl))
                hook = asyncio.ensure_future(self._isolate_hook(inc, host))  # beside the agent
                try:
                    await self._command(inc, step, "isolate", [host], persist, host=host)
                finally:
                    run = await hook
                self._note_hook(inc, step, host, run)
                await self.store.note_attempt(inc.job, None, time.time())
            case "restart":
                await self._restart(inc, step, persist)
            case "hold":
                view = await self.store.view(inc.job, inc.cause)
                moot = endings.moot(inc, view, "hold")
                if moot is not None:
                    step.status, step.detail = moot
                else:
                    await self._command(inc, step, "hold", sorted(view.hosts), persist,
                                        everyone=True)
            case _:
                step.status, step.detail = "skipped", f"unknown action {step.action}"

    async def _isolate_hook(self, inc: Incident, host: str) -> HookRun | None:
        """Take ``host`` out of the scheduler too (None: no hook configured)."""
        if self.isolate_hook is None:
            return None
        return await self.isolate_hook.run(
            {"host": host, "job": inc.job, "incident": inc.id, "cause": inc.cause,
             "reason": inc.summary or inc.cause}, self.settings.hook_timeout)

    def _note_hook(self, inc: Incident, step: IncidentStep, host: str,
                   run: HookRun | None) -> None:
        """Keep the hook's outcome on the step. A failed hook does not fail the isolation
        (the blocklist and the agent already keep the host out of trainguard jobs); it is
        logged as an error for the operator."""
        if run is None:
            return
        step.hook = run
        line = hooks.summary(run)
        step.detail = f"{step.detail}; {line}" if step.detail else line
        logger = log.bind(job=inc.job, incident=inc.id, host=host)
        if run.status == "ok":
            logger.info("isolate hook for %s: %s", host, line)
        else:
            logger.error("isolate hook for %s: %s", host, line)

    async def _sweep_blocklist(self) -> None:
        """Remove ended blocklist entries (their TTL, or ``trainguard unblock``), then give
        the hosts back to the scheduler (``release_hook``). Leader only; the delete is a
        fenced compare-and-delete, so a host re-isolated meanwhile stays blocked and keeps
        its cordon."""
        assert self.leader is not None
        if not self.leader.leading:
            return
        for host, value, entry in await self.store.ended(time.time()):
            logger = log.bind(job=entry.job or None, incident=entry.incident or None,
                              host=host)
            try:
                # Removed first: a host re-isolated meanwhile keeps its entry and its cordon.
                if not await self.store.unblock(host, value):
                    continue
            except NotLeader:
                return
            logger.info("host %s left the blocklist (%s)", host,
                        entry.released_by or "its ttl ended")
            if self.release_hook is not None:
                run = await self.release_hook.run(
                    {"host": host, "job": entry.job, "incident": entry.incident,
                     "cause": entry.cause, "reason": entry.released_by or "blocklist ttl"},
                    self.settings.hook_timeout)
                (logger.info if run.status == "ok" else logger.error)(
                    "release hook for %s: %s", host, hooks.summary(run))

    async def _reload(self, inc: Incident, step: IncidentStep, at: int, path: str) -> None:
        """Roll back in place: every rank loads checkpoint ``at`` in-process at one agreed
        step (``reload``, collective, to ``cmd.all``). All of them done: no process
        restarts (the plan's restart is skipped); otherwise the restart of today runs."""
        assert self.leader is not None
        view = await self.store.view(inc.job, inc.cause)
        if view.world_size <= 0:
            step.detail += "; no reload in place: the job's world size is unknown"
            return
        subject, cmd = addressed(self.settings.subjects, inc.job, "reload",
                                 {"step": at, "path": path}, issuer="remediator",
                                 everyone=True, epoch=self.leader.epoch,
                                 seq=await self.store.next_seq(inc.job),
                                 deadline=self.policy.ack_timeout_s)
        step.command_ids.append(cmd.id)
        await self.runtime.publish_event(subject, cmd)
        acks = await self._acks.collect(cmd.id, recovery.reload_responders(view.world_size),
                                        self.policy.ack_timeout_s)
        done, detail = recovery.reload_verdict(acks, view.world_size)
        step.params[recovery.RELOADED] = done
        step.detail = f"{step.detail}; {detail}"
        # Not done: the plan's restart follows, from the pointer as it stands. What the job
        # saved of its bad state meanwhile is suspect by its state_since, so no second
        # rollback: one after another incident restarted the group would mark the fresh
        # group's saves suspect.

    async def _restart(self, inc: Incident, step: IncidentStep, persist: Persist) -> None:
        if recovery.rolled_back_in_place(inc):
            step.status = "skipped"
            step.detail = "rolled back in place on every rank: no process restarted"
            return
        view = await self.store.view(inc.job, inc.cause)
        if "rank" in step.params:
            await self._restart_culprit(inc, step, view, persist)
            return
        if recovery.isolated(inc):
            deadline = time.monotonic() + recovery.RESIZE_WAIT_S
            while time.monotonic() < deadline and not self._in_place(inc, view):
                await asyncio.sleep(0.5)
                view = await self.store.view(inc.job, inc.cause)
        if rules.waits_for_launcher(inc):
            deadline = time.monotonic() + self.policy.launcher_grace_s
            while time.monotonic() < deadline and not rules.launcher_restarted(inc, view) \
                    and not self._in_place(inc, view):
                await asyncio.sleep(1.0)
                view = await self.store.view(inc.job, inc.cause)
        if self._in_place(inc, view):
            step.status, step.detail = "skipped", recovery.skip_detail(inc)
            return
        if rules.launcher_restarted(inc, view):
            rules.skip_restart(inc, step, view)
            return
        moot = endings.moot(inc, view, "restart")
        if moot is not None:
            step.status, step.detail = moot
            return
        inc.restarted_attempt = view.attempt
        await self._command(inc, step, "restart", sorted(view.hosts), persist, everyone=True)
        await self.store.note_attempt(inc.job, view.attempt, time.time())  # the one it ends

    @staticmethod
    def _in_place(inc: Incident, view: rules.JobView) -> bool:
        """The agent replaced ``inc``'s rank in place (its report came): that is the
        launcher's restart, and the survivors' attempt does not rise to say so."""
        recovery.apply(inc, view.recoveries)
        return recovery.recovered_in_place(inc)

    async def _restart_culprit(self, inc: Incident, step: IncidentStep, view: rules.JobView,
                               persist: Persist) -> None:
        """Restart the one culprit rank: in place when its group can take it (the agent
        kills it at once and starts a replacement), else the agent restarts the group."""
        moot = endings.moot(inc, view, "restart")
        if moot is not None:
            step.status, step.detail = moot
            return
        host = str(step.params["host"])
        inc.restarted_attempt = view.attempt
        await self._command(inc, step, "restart", [host], persist, host=host,
                            params={"rank": step.params["rank"],
                                    "fallback": step.params.get("fallback", "group")})
        await self.store.note_attempt(inc.job, None, time.time())  # each one counts

    async def _command(self, inc: Incident, step: IncidentStep, kind: str, hosts: list[str],
                       persist: Persist, *, params: dict[str, Any] | None = None,
                       host: str | None = None, everyone: bool = False) -> None:
        """Send, await acks from ``hosts``; send again once as a retry (the verdict says
        when), then the step has failed."""
        assert self.leader is not None
        retry_of = step.command_ids[-1] if step.command_ids else None
        given = {k: v for k, v in (params or {}).items() if v is not None}
        for _ in range(2):
            subject, cmd = addressed(self.settings.subjects, inc.job, kind, given,
                                     issuer="remediator", host=host, everyone=everyone,
                                     epoch=self.leader.epoch,
                                     deadline=self.policy.ack_timeout_s, retry_of=retry_of)
            step.command_ids.append(cmd.id)
            step.status = "sent"
            await persist()
            await self.runtime.publish_event(subject, cmd)
            acks = await self._acks.collect(cmd.id, hosts, self.policy.ack_timeout_s)
            verdict = rules.ack_verdict(acks, hosts, kind, step.detail)
            step.status, step.detail = verdict.status, verdict.detail
            if not verdict.retry:
                return
            retry_of = cmd.id

    # -- resolution ------------------------------------------------------------------------
    async def _watch(self) -> None:
        """End the incidents whose steps have run, as :func:`.endings.resolution` decides,
        and hold the jobs that cannot recover (:func:`.endings.hold_reason`)."""
        assert self.leader is not None
        if not self.leader.leading:
            if self._metrics is not None:
                self._metrics.show_open(())  # the leader exports them
            return
        now = time.time()
        listing = await self.store.open_all()
        if self._metrics is not None:
            self._metrics.show_open(listing)
        for listed in listing:
            task, lock = self._running.get(listed.id), self._lock(listed.id)
            if (task is not None and not task.done()) or lock.locked():
                continue
            try:
                async with lock:
                    inc = await self.store.load(listed.job, listed.id)
                    if inc is not None and rules.is_open(inc) and await self._end(inc, now):
                        self._run(inc)
            except NotLeader:
                return

    async def _end(self, inc: Incident, now: float) -> bool:
        """Settle ``inc`` if it is over, or give it the steps that hold its job (True: run
        them)."""
        view = await self.store.view(inc.job, inc.cause)
        noted = recovery.apply(inc, view.recoveries)
        why = endings.resolution(inc, view, self._resolved_anomalies, self.policy, now)
        if why is not None:
            resume = await self.coordinator.resume_step(inc.job) \
                if endings.needs_resume_step(inc, why) else None
            endings.settle(inc, why, self.policy, now, resume)
            await self._save(inc)
            return False
        reason = endings.hold_reason(inc, view, self.policy)
        if reason is None:
            if noted:
                await self._save(inc)  # which path ran, and why: a revision of its own
            return False
        log.bind(job=inc.job, incident=inc.id).warning("holding job %s (incident %s): %s",
                                                       inc.job, inc.id, reason)
        inc.actions.extend(rules.hold_steps(inc, reason))
        await self._save(inc)
        return True

