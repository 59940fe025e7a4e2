"""The remediator's async shell: diagnoses in; commands, incidents and actions out.

The engine decides, the shell carries out. What a diagnosis does to the job's incidents is
:mod:`.intake` (which incident, opened or joined, re-planned: :mod:`.engine`); what the
executor does next with an incident and what each step takes and means is :mod:`.conduct`;
when an incident ends or its job must be held is :mod:`.endings`. This module loads and
saves incidents, counts the launcher's attempts from worker exits, keeps the node records
from the agents' hellos, sends commands (:func:`trainguard.contract.targets.addressed`) and
collects their acks, calls the checkpoint coordinator (:mod:`trainguard.contract.rpc`),
runs the hooks, publishes and waits.

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
    Command,
    CommandAck,
    Diagnosis,
    HookRun,
    Incident,
    IncidentStep,
    NodeHello,
    PreflightReport,
    RankHello,
    RecoveryReport,
    WorkerExit,
)
from trainguard.contract.targets import addressed
from trainguard.runtime.fencing import Epochs
from trainguard.runtime.jobmetrics import IncidentMetrics, PreflightMetrics
from trainguard.runtime.logs import get_logger
from trainguard.runtime.presence import Presence
from trainguard.runtime.service import TRANSIENT_ERRORS, Consumer, Delivery, Runtime, Service
from trainguard.runtime.state import Keys
from trainguard.runtime.topology import ConsumerSpec

from . import conduct, endings, hooks, intake, preflight
from . import engine as rules
from .acks import AckBox
from .conduct import Send
from .coordinator import Coordinator
from .engine import Outcome
from .hooks import Hook
from .leader import Leadership, NotLeader
from .policy import Policy, load_policy
from .settings import RemediatorSettings
from .store import Store

log = get_logger("trainguard.remediator")

NOT_LEADER_RETRY_S = 0.05
"""How soon a standby hands a diagnosis (or pre-flight) back for redelivery. The replicas
share one consumer, so about half the messages reach a standby first: a second's delay
there (jittered to 1.5 s) was added to every other decision. Handed back this soon, the
next delivery likely reaches the leader; with no leader yet, the message cycles cheaply
until one takes over (or it ages into the dead-letter subject, as any retry does)."""

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
        self._preflights: PreflightMetrics | None = None
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
            Consumer(ConsumerSpec("events", "remediator-preflight",
                                  (s.pattern("event", tail="preflight"),)),
                     self.on_preflight, (PreflightReport,)),
        ]

    async def start(self, rt: Runtime) -> None:
        epochs = Epochs(rt.bus.js, self.settings.prefix, self.settings.stream_replicas)
        presence = Presence(rt.bus.nc, self.settings.subjects, "remediator")
        self.leader = Leadership(rt.redis, self.keys, epochs, ttl=self.settings.lease_ttl,
                                 presence=presence)
        await presence.serve(self.leader.lease.holder)  # before the lock can name us
        self._metrics = IncidentMetrics(rt.metrics.registry, "remediator")
        self._preflights = PreflightMetrics(rt.metrics.registry)
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
            started = time.monotonic()
            resumed = await self.store.open_all()
            log.info("remediator: leading with epoch %d (%d open incidents read in %.0f ms)",
                     self.leader.epoch, len(resumed), (time.monotonic() - started) * 1000)
            for inc in resumed:
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
        member = endings.exit_entry(ex, time.time())
        if member is not None:
            await self.store.note_ended(ex.job, member, ex.time or time.time())

    async def on_recovery(self, report: RecoveryReport, delivery: Delivery) -> None:
        """Keep a rank's or agent's account of a recovery (any replica: keyed by its id);
        the leader's incidents read it (:mod:`.recovery`) as they wait and resolve."""
        await self.store.note_recovery(report)

    async def on_hello(self, hello: NodeHello | RankHello, delivery: Delivery) -> None:
        """Keep the host's node record from its agent's durable hellos (any replica: the
        write is a compare-and-set on the hello's time); agents never write Redis."""
        if isinstance(hello, NodeHello):
            await self.store.record_node(hello)

    async def on_preflight(self, report: PreflightReport, delivery: Delivery) -> None:
        """A node's pre-flight: the policy's ``[preflight]`` blocklists a failed node
        before it joins (leader only: the write is fenced), runs the isolate hook, and
        announces it."""
        assert self.leader is not None
        now = time.time()
        gate = preflight.decide(report, self.policy, now)
        if gate is not None and not self.leader.leading:
            raise Retry(delay=NOT_LEADER_RETRY_S, reason="not the leader")
        if self._preflights is not None:
            self._preflights.observe(report)
        if gate is None:
            return
        logger = log.bind(job=report.job, host=report.host)
        if gate.action == "isolate":
            # An active entry (an isolation, a redelivery of this record) stays as it is.
            fresh = report.host not in await self.store.blocked(now)
            if fresh:
                await self.store.block(report.host, preflight.blocklist_entry(
                    report, gate, now, self.settings.blocklist_ttl))
                logger.warning("blocklisted %s: %s", report.host, gate.reason)
            if fresh and self.isolate_hook is not None:  # a redelivery runs it once
                run = await self.isolate_hook.run(
                    {"host": report.host, "job": report.job, "incident": "",
                     "cause": preflight.CAUSE, "reason": gate.reason},
                    self.settings.hook_timeout)
                (logger.info if run.status == "ok" else logger.error)(
                    "isolate hook for %s: %s", report.host, hooks.summary(run))
        await self.runtime.publish_event(self.settings.subjects.event(report.job, "action"),
                                         preflight.action_event(report, gate, now),
                                         ctx=delivery.ctx)

    async def on_diagnosis(self, d: Diagnosis, delivery: Delivery) -> None:
        assert self.leader is not None
        if not self.leader.leading:
            raise Retry(delay=NOT_LEADER_RETRY_S, reason="not the leader")
        now = time.time()
        found = rules.find_incident(await self.store.of(d.job), d, self.policy.cooldown_s, now)
        if found is None:
            await self._admit(d, None, now, delivery.ctx)
            return
        lock = self._lock(found.id)
        if lock.locked():
            raise Retry(delay=1.0, reason=f"incident {found.id} is running a step")
        async with lock:  # join what its last step saved, if it still takes this diagnosis
            await self._admit(d, await self.store.load(d.job, found.id), now, delivery.ctx)

    async def _admit(self, d: Diagnosis, candidate: Incident | None, now: float,
                     ctx: Context | None) -> None:
        """Carry out :func:`.intake.admit`; then run the incident's steps. ``ctx``: the
        diagnosis' trace."""
        with self.runtime.tracer.start_as_current_span(
            f"decide {d.cause}", context=ctx, attributes={
                "trainguard.job": d.job, "trainguard.cause": d.cause,
                "trainguard.hosts": ",".join(d.hosts),
                "trainguard.ranks": ",".join(map(str, d.ranks))},
        ):
            admission = intake.admit(d, candidate, self.policy.cooldown_s, now)
            inc = admission.incident
            if inc is None:
                return
            # A new incident's failure attempt is the job's now; the plan sees the count.
            failed = await self.store.view(d.job, d.cause) if admission.opened else None
            if admission.counted:
                await self.store.note_cause(d, now)
            if admission.replan:
                intake.plan(admission, d, self.policy,
                            await self.store.view(d.job, inc.cause), now,
                            failed.attempt if failed else None,
                            failed.generation if failed else None)
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
                    move, inc = await self._step(ident, job)
                except TRANSIENT_ERRORS as exc:
                    log.bind(job=job, incident=ident).warning(
                        "incident %s paused %.1fs: %r", ident, pause, exc)
                    await asyncio.sleep(pause)
                    pause = min(TRANSIENT_PAUSE_MAX_S, pause * 2)
                    continue
                pause = TRANSIENT_PAUSE_S
                if move.index is None or inc is None:
                    return
                if not move.grace:
                    continue
                # Unlocked: a better diagnosis (superseding this guess) may re-plan meanwhile.
                await asyncio.sleep(move.grace)
                async with self._lock(ident):
                    fresh = await self.store.load(job, ident)
                    if fresh is not None and conduct.waited(fresh, inc, move.index):
                        await self._save(fresh, publish=False)
                # re-planned meanwhile, or waited: the loop runs what is planned now
        except NotLeader:
            log.warning("lost leadership during incident %s", ident)

    async def _step(self, ident: str, job: str) -> tuple[conduct.Move, Incident | None]:
        """Make the incident's next move (:func:`.conduct.next_move`): run its next step,
        or conclude it, or say how long its grace still is."""
        async with self._lock(ident):
            inc = await self.store.load(job, ident)
            move = conduct.next_move(inc, time.time())
            if move.save and inc is not None:
                await self._save(inc)
            if inc is None or move.index is None or move.grace:
                return move, inc
            step = inc.actions[move.index]
            # Read as the step is about to take effect: a switch applies from the next step.
            observed = rules.observing(self.policy, await self.store.mode(inc.job))
            await self._do(inc, step, functools.partial(self._save, inc, publish=False),
                           observed)
            rules.finish_step(inc, step)
            # Saved before it is announced: a publish that fails now cannot run it again.
            await self._save(inc)
            await self.runtime.publish_event(self.settings.subjects.event(inc.job, "action"),
                                             rules.action_event(inc, step, time.time()))
            return move, inc

    async def _do(self, inc: Incident, step: IncidentStep, persist: Persist,
                  observed: frozenset[str] = frozenset()) -> None:
        with self.runtime.tracer.start_as_current_span(
            f"act {step.action}", attributes={"trainguard.job": inc.job,
                                              "trainguard.incident": inc.id,
                                              "trainguard.cause": inc.cause,
                                              "trainguard.action": step.action},
        ) as span:
            try:
                await self._carry_out(inc, step, conduct.act(inc, step), persist, observed)
            except NotLeader:
                raise
            except TRANSIENT_ERRORS:
                raise  # not the step's failure: the executor pauses and runs it again
            except Exception as exc:  # any other failure of a step escalates its incident
                step.status, step.detail = "failed", f"{type(exc).__name__}: {exc}"
            span.set_attribute("trainguard.outcome", step.status)

    async def _carry_out(self, inc: Incident, step: IncidentStep, act: conduct.Act,
                         persist: Persist, observed: frozenset[str] = frozenset()) -> None:
        """Do what :func:`.conduct.act` (or a look at the job) decided for ``step``; in
        observe mode (``observed``) record what it would have done instead
        (:func:`.conduct.observe`): no command, no blocklist entry, no hook, no count."""
        recorded = conduct.observe(inc, step, act, observed)
        if recorded is not None:
            step.status, step.detail = recorded
            return
        match act:
            case Outcome(status, detail):
                step.status, step.detail = status, detail
            case conduct.Save(deadline):
                step.status, step.detail = await self.coordinator.save(inc.job, deadline)
            case conduct.Rollback(below_step):
                reply, (step.status, step.detail) = await self.coordinator.rollback_to(
                    inc.job, below_step)
                point = conduct.reload_point(step, reply)
                if point is not None:
                    await self._reload(inc, step, *point)
            case Send():
                await self._send(inc, step, act, persist)
                if act.counts:
                    await self.store.note_attempt(inc.job, act.attempt, time.time())
            case conduct.SendEach(sends):
                await self._send_each(inc, step, sends, persist)
            case conduct.Isolate(send):
                await self._isolate(inc, step, send, persist)
            case conduct.Fence(hosts, send):
                await self._fence(inc, step, hosts, send, persist)
            case conduct.Restart():
                view = await self.store.view(inc.job, inc.cause)
                for wait in conduct.restart_waits(inc, step, self.policy):
                    view = await self._wait(inc, view, wait)
                await self._carry_out(inc, step, conduct.restart(inc, step, view), persist,
                                      observed)
            case conduct.Hold():
                view = await self.store.view(inc.job, inc.cause)
                await self._carry_out(inc, step, conduct.hold(inc, step, view), persist,
                                      observed)

    async def _wait(self, inc: Incident, view: rules.JobView,
                    wait: conduct.Wait) -> rules.JobView:
        """The job's view once ``wait.until`` holds, or when ``wait.seconds`` are over."""
        deadline = time.monotonic() + wait.seconds
        while time.monotonic() < deadline and not wait.until(inc, view):
            await asyncio.sleep(wait.every)
            view = await self.store.view(inc.job, inc.cause)
        return view

    async def _send(self, inc: Incident, step: IncidentStep, send: Send,
                    persist: Persist) -> None:
        """Send, await acks from ``send.hosts``; send again as a retry while
        :func:`.conduct.judge` says so, at most :data:`.conduct.SENDS` times in all."""
        assert self.leader is not None
        retry_of = send.retry_of
        for _ in range(conduct.SENDS):
            subject, cmd = addressed(self.settings.subjects, inc.job, send.kind, send.params,
                                     issuer="remediator", host=send.host,
                                     everyone=send.everyone, epoch=self.leader.epoch,
                                     deadline=self.policy.ack_timeout_s, retry_of=retry_of)
            conduct.sent(step, cmd.id)
            await persist()
            await self.runtime.publish_event(subject, cmd)
            acks = await self._acks.collect(cmd.id, send.hosts, self.policy.ack_timeout_s)
            if not conduct.judge(step, acks, send):
                return
            retry_of = cmd.id

    async def _to_each_host(self, inc: Incident, step: IncidentStep,
                            sends: list[tuple[str, dict[str, Any], str]],
                            persist: Persist) -> list[Command]:
        """Send each ``(kind, params, host)`` to its host's agent, all at once, the step
        saved with their ids first (a successor leader must know they went out); returns
        the commands in ``sends``' order, for their acks."""
        assert self.leader is not None
        out = [addressed(self.settings.subjects, inc.job, kind, params, issuer="remediator",
                         host=host, epoch=self.leader.epoch,
                         deadline=self.policy.ack_timeout_s) for kind, params, host in sends]
        for _, cmd in out:
            conduct.sent(step, cmd.id)
        await persist()
        await asyncio.gather(*(self.runtime.publish_event(subject, cmd)
                               for subject, cmd in out))
        return [cmd for _, cmd in out]

    async def _send_each(self, inc: Incident, step: IncidentStep, sends: list[Send],
                         persist: Persist) -> None:
        """Each of ``sends`` to its host, all at once, their acks awaited together: one
        ack deadline for the step however many hosts it names, not one (or two) per host."""
        commands = await self._to_each_host(
            inc, step, [(send.kind, send.params, str(send.host)) for send in sends], persist)
        acks = await asyncio.gather(*(
            self._acks.collect(cmd.id, send.hosts, self.policy.ack_timeout_s)
            for cmd, send in zip(commands, sends, strict=True)))
        conduct.judge(step, [a for got in acks for a in got],
                      Send(sends[0].kind, [h for send in sends for h in send.hosts]))

    async def _isolate(self, inc: Incident, step: IncidentStep, send: Send,
                       persist: Persist) -> None:
        """Block the host, take it out of the scheduler too (the hook runs beside the
        agent's ``isolate``), then count the attempt the isolation ends."""
        host = str(send.host)
        await self.store.block(host, rules.blocklist_entry(
            inc, time.time(), self.settings.blocklist_ttl))
        hook = asyncio.ensure_future(self._isolate_hook(inc, host))
        try:
            await self._send(inc, step, send, persist)
        finally:
            run = await hook
        if run is not None:
            line = conduct.note_hook(step, run)
            logger = log.bind(job=inc.job, incident=inc.id, host=host)
            (logger.info if run.status == "ok" else logger.error)(
                "isolate hook for %s: %s", host, line)
        if send.counts:
            await self.store.note_attempt(inc.job, send.attempt, time.time())

    async def _fence(self, inc: Incident, step: IncidentStep, hosts: list[str], send: Send,
                     persist: Persist) -> None:
        """Hosts lost together leave together: block them all, run the isolate hook for
        each and tell each agent, all at once (a rack is dozens of hosts: one round trip,
        not one per host), awaiting no ack (a lost host's agent cannot answer), and count
        the one attempt their loss ends."""
        assert self.leader is not None
        now = time.time()
        await asyncio.gather(*(self.store.block(host, rules.blocklist_entry(
            inc, now, self.settings.blocklist_ttl)) for host in hosts))
        hooks_run = asyncio.gather(*(self._isolate_hook(inc, h) for h in hosts))
        commands = await self._to_each_host(
            inc, step, [(send.kind, send.params, host) for host in hosts], persist)
        runs = await hooks_run
        acks = [a for cmd in commands for a in await self._acks.collect(cmd.id, (), 0.0)]
        conduct.fenced(step, hosts, acks, inc.domain)
        for host, run in zip(hosts, runs, strict=True):
            if run is not None:
                line = conduct.note_hook(step, run)
                logger = log.bind(job=inc.job, incident=inc.id, host=host)
                (logger.info if run.status == "ok" else logger.error)(
                    "isolate hook for %s: %s", host, line)
        await self.store.note_attempt(inc.job, send.attempt, time.time())

    async def _isolate_hook(self, inc: Incident, host: str) -> HookRun | None:
        """Take ``host`` out of the scheduler too (None: no hook configured)."""
        if self.isolate_hook is None:
            return None
        return await self.isolate_hook.run(
            {"host": host, "job": inc.job, "incident": inc.id, "cause": inc.cause,
             "reason": inc.summary or inc.cause}, self.settings.hook_timeout)

    async def _reload(self, inc: Incident, step: IncidentStep, at: int, path: str) -> None:
        """Roll back in place: every rank loads checkpoint ``at`` in-process at one agreed
        step (:func:`.conduct.reload`); :func:`.conduct.reloaded` says what came of it."""
        assert self.leader is not None
        view = await self.store.view(inc.job, inc.cause)
        reload = conduct.reload(step, view, at, path)
        if reload is None:
            return
        subject, cmd = addressed(self.settings.subjects, inc.job, "reload", reload.params,
                                 issuer="remediator", everyone=True, epoch=self.leader.epoch,
                                 seq=await self.store.next_seq(inc.job),
                                 deadline=self.policy.ack_timeout_s)
        step.command_ids.append(cmd.id)
        await self.runtime.publish_event(subject, cmd)
        acks = await self._acks.collect(cmd.id, reload.responders, self.policy.ack_timeout_s)
        conduct.reloaded(step, acks, view.world_size)

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

    # -- resolution ------------------------------------------------------------------------
    async def _watch(self) -> None:
        """End the incidents whose steps have run, and hold the jobs that cannot recover,
        as :func:`.endings.review` decides."""
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
        review = endings.review(inc, await self.store.view(inc.job, inc.cause),
                                self._resolved_anomalies, self.policy, now)
        if review.resolution is not None:
            resume = await self.coordinator.resume_step(inc.job) if review.resume else None
            endings.settle(inc, review.resolution, self.policy, now, resume)
        elif review.hold is not None:
            log.bind(job=inc.job, incident=inc.id).warning(
                "holding job %s (incident %s): %s", inc.job, inc.id, review.hold)
        if review.save:
            await self._save(inc)
        return review.hold is not None
