"""The remediator's async shell: diagnoses in; commands, incidents and actions out.

Every decision (which incident a diagnosis joins, its plan, the next step, what the acks
mean, whether the launcher already restarted, when an incident ends) is a pure function
in :mod:`.engine`; this module loads and saves incidents, sends commands
(:func:`trainguard.targets.addressed`), calls the checkpoint coordinator
(:mod:`trainguard.rpc`) and waits.

Only the leader acts (:mod:`.leader`); other replicas ``nak`` diagnoses with a delay.
Incidents and their plans live in Redis (fenced writes), so a new leader resumes open
incidents where the old one stopped: steps already acknowledged are not run again, and a
step that was sent but not acknowledged is re-sent as a retry (``retry_of``), which agents
answer without running it twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from trainguard.codec import decode_durable
from trainguard.errors import DecodeError, Retry
from trainguard.schemas import Anomaly, CommandAck, Diagnosis, Incident, IncidentStep
from trainguard.service import Consumer, Delivery, Runtime, Service
from trainguard.state import Keys
from trainguard.targets import addressed
from trainguard.topology import ConsumerSpec

from . import engine as rules
from .acks import AckBox
from .coordinator import Coordinator
from .leader import Leadership, NotLeader
from .policy import Policy, load_policy
from .settings import RemediatorSettings
from .store import Store

log = logging.getLogger("trainguard.remediator")

Persist = Callable[[], Awaitable[None]]
"""Saves the incident before a command goes out: a successor must know it was sent."""


class RemediatorService(Service):
    name = "remediator"
    settings_type = RemediatorSettings

    def __init__(self, settings: RemediatorSettings) -> None:
        super().__init__(settings)
        self.cfg = settings
        self.policy: Policy = load_policy(settings.policy or None)
        self.keys = Keys(settings.prefix)
        self.rt: Runtime | None = None
        self.leader: Leadership | None = None
        self._store: Store | None = None
        self._coordinator: Coordinator | None = None
        self._acks = AckBox()
        self._running: dict[str, asyncio.Task[None]] = {}
        self._resolved_anomalies: set[str] = set()

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
        ]

    async def start(self, rt: Runtime) -> None:
        self.rt = rt
        self.leader = Leadership(rt.redis, self.keys, ttl=self.cfg.lease_ttl)
        self._store = Store(rt.redis, self.keys, self.leader)
        self._coordinator = Coordinator(rt.bus.nc, self.settings.subjects)
        await rt.bus.nc.subscribe(self.settings.subjects.pattern("ack", tail="remediator"),
                                  cb=self._on_ack)
        rt.every(self.cfg.lease_ttl / 4, self._lead, "leadership")
        rt.every(1.0, self._watch, "resolution")

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
        if await self.leader.tick() and not was:
            log.info("remediator: leading with epoch %d", self.leader.epoch)
            for inc in await self.store.open_all():
                log.info("resuming incident %s of %s", inc.id, inc.job)
                self._run(inc)

    # -- inputs ---------------------------------------------------------------------------
    async def _on_ack(self, msg: Any) -> None:
        try:
            ack = decode_durable(msg.data, CommandAck)
        except DecodeError:  # malformed acks are the sender's problem; ignore
            return
        self._acks.add(ack)

    async def on_anomaly(self, a: Anomaly, delivery: Delivery) -> None:
        if a.status == "resolved":
            self._resolved_anomalies.add(a.id)

    async def on_diagnosis(self, d: Diagnosis, delivery: Delivery) -> None:
        assert self.rt is not None and self.leader is not None
        if not self.leader.leading:
            raise Retry(delay=1.0, reason="not the leader")
        now = time.time()
        incidents = await self.store.open_of(d.job)
        with self.rt.tracer.start_as_current_span(
            f"decide {d.cause}", context=delivery.ctx,
            attributes={"trainguard.job": d.job, "trainguard.cause": d.cause,
                        "trainguard.hosts": ",".join(d.hosts),
                        "trainguard.ranks": ",".join(map(str, d.ranks))},
        ):
            inc = rules.find_incident(incidents, d, self.policy.cooldown_s, now)
            if inc is None:
                if d.status == "superseded":
                    return  # its successor carries the story
                inc = rules.open_incident(d, rules.detected_at(d, now), now)
                inc.failure_attempt = (await self.store.view(d.job, d.cause)).attempt
                await self.store.note_cause(inc, now)
                replan = True
            else:
                replan = rules.join(inc, d) and rules.is_open(inc)
            if replan:
                rules.replan(inc, d, self.policy, await self.store.view(d.job, inc.cause), now)
            await self._save(inc)
            self._run(inc)

    # -- incidents ------------------------------------------------------------------------
    async def _save(self, inc: Incident, *, publish: bool = True) -> None:
        """Persist ``inc`` (fenced); ``publish``: a new revision for the event stream."""
        assert self.rt is not None
        if publish:
            inc.rev += 1
        await self.store.save(inc)
        if publish:
            await self.rt.publish_event(self.settings.subjects.event(inc.job, "incident"), inc)

    def _run(self, inc: Incident) -> None:
        assert self.rt is not None
        task = self._running.get(inc.id)
        if task is not None and not task.done():
            return
        self._running[inc.id] = self.rt.spawn(self._execute(inc.id, inc.job),
                                              f"incident:{inc.id}")

    async def _execute(self, ident: str, job: str) -> None:
        """Run the incident's pending steps in order, persisting after each."""
        assert self.rt is not None and self.leader is not None
        try:
            while self.leader.leading:
                inc = await self.store.load(job, ident)
                if inc is None or not rules.is_open(inc):
                    return
                index = rules.next_step(inc)
                if index is None:
                    if rules.conclude(inc, time.time()):
                        await self._save(inc)
                    return
                step = inc.actions[index]
                grace = rules.grace_to_wait(step)
                if grace:
                    # Give a better diagnosis (superseding this guess) a moment to arrive.
                    await asyncio.sleep(grace)
                    fresh = await self.store.load(job, ident)
                    if fresh is not None and fresh.actions == inc.actions:
                        fresh.actions[index].params["waited"] = True
                        await self._save(fresh, publish=False)
                    continue  # re-planned meanwhile, or waited: run what is planned now
                rules.start_step(inc, step, time.time())
                await self._do(inc, step, functools.partial(self._save, inc, publish=False))
                rules.finish_step(inc, step)
                await self._save(inc)
        except NotLeader:
            log.warning("lost leadership during incident %s", ident)

    async def _do(self, inc: Incident, step: IncidentStep, persist: Persist) -> None:
        assert self.rt is not None
        with self.rt.tracer.start_as_current_span(
            f"act {step.action}", attributes={"trainguard.job": inc.job,
                                              "trainguard.incident": inc.id,
                                              "trainguard.cause": inc.cause,
                                              "trainguard.action": step.action},
        ) as span:
            try:
                await self._dispatch(inc, step, persist)
            except NotLeader:
                raise
            except Exception as exc:  # any failure of a step escalates its incident
                step.status, step.detail = "failed", f"{type(exc).__name__}: {exc}"
            span.set_attribute("trainguard.outcome", step.status)
        await self.rt.publish_event(self.settings.subjects.event(inc.job, "action"),
                                    rules.action_event(inc, step, time.time()))

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
                step.status, step.detail = await self.coordinator.rollback(
                    inc.job, int(step.params.get("below_step", 0)))
            case "dump":
                host = str(step.params["host"])
                await self._command(inc, step, "dump", [host], persist, host=host,
                                    params={"ranks": step.params.get("ranks")})
            case "isolate":
                host = str(step.params["host"])
                await self.store.block(host, rules.blocklist_entry(inc, time.time()))
                await self._command(inc, step, "isolate", [host], persist, host=host)
                await self.store.note_restart(inc.job)
            case "restart":
                await self._restart(inc, step, persist)
            case _:
                step.status, step.detail = "skipped", f"unknown action {step.action}"

    async def _restart(self, inc: Incident, step: IncidentStep, persist: Persist) -> None:
        view = await self.store.view(inc.job, inc.cause)
        if rules.waits_for_launcher(inc):
            deadline = time.monotonic() + self.policy.launcher_grace_s
            while time.monotonic() < deadline and not rules.launcher_restarted(inc, view):
                await asyncio.sleep(1.0)
                view = await self.store.view(inc.job, inc.cause)
        if rules.launcher_restarted(inc, view):
            rules.skip_restart(inc, step, view)
            return
        inc.restarted_attempt = view.attempt
        await self._command(inc, step, "restart", sorted(view.hosts), persist, everyone=True)
        await self.store.note_restart(inc.job)

    async def _command(self, inc: Incident, step: IncidentStep, kind: str, hosts: list[str],
                       persist: Persist, *, params: dict[str, Any] | None = None,
                       host: str | None = None, everyone: bool = False) -> None:
        """Send, await acks from ``hosts``; send again once as a retry (the verdict says
        when), then the step has failed."""
        assert self.rt is not None and self.leader is not None
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
            await self.rt.publish_event(subject, cmd)
            acks = await self._acks.collect(cmd.id, hosts, self.policy.ack_timeout_s)
            verdict = rules.ack_verdict(acks, hosts, kind, step.detail)
            step.status, step.detail = verdict.status, verdict.detail
            if not verdict.retry:
                return
            retry_of = cmd.id

    # -- resolution ------------------------------------------------------------------------
    async def _watch(self) -> None:
        """End the incidents whose steps have run, as :func:`.engine.resolution` decides."""
        assert self.rt is not None and self.leader is not None
        if not self.leader.leading:
            return
        now = time.time()
        for inc in await self.store.open_all():
            task = self._running.get(inc.id)
            if task is not None and not task.done():
                continue
            view = await self.store.view(inc.job, inc.cause)
            why = rules.resolution(inc, view, self._resolved_anomalies, self.policy, now)
            if why is None:
                continue
            resume = await self.coordinator.resume_step(inc.job) \
                if rules.needs_resume_step(inc, why) else None
            rules.settle(inc, why, self.policy, now, resume)
            try:
                await self._save(inc)
            except NotLeader:
                return

