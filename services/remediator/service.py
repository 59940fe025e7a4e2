"""The remediator's async shell: diagnoses in; commands, incidents and actions out.

Only the leader acts; other replicas ``nak`` diagnoses with a delay. Incidents and their
plans live in Redis (fenced writes), so a new leader resumes open incidents where the old
one stopped: steps already acknowledged are not run again, and a step that was sent but
not acknowledged is re-sent as a retry (``retry_of``), which agents answer without running
it twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec

from trainguard.codec import decode_durable, encode_durable
from trainguard.envelope import uuid7
from trainguard.errors import Retry
from trainguard.schemas import Action, Anomaly, Command, CommandAck, Diagnosis, Incident
from trainguard.service import Consumer, Delivery, Runtime, Service
from trainguard.state import Keys, decode_progress
from trainguard.topology import ConsumerSpec

from .engine import JobView, Step, find_incident, join, open_incident, plan, resolved_by_progress
from .leader import Leadership, NotLeader
from .policy import Policy, load_policy
from .settings import RemediatorSettings

log = logging.getLogger("trainguard.remediator")

HOUR = 3600.0
CRASHING = frozenset({"process_crash", "oom", "hbm_ecc"})
"""Causes whose evidence is a dead worker (the launcher restarts those by itself)."""


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
        self._acks: dict[str, list[CommandAck]] = {}
        self._ack_events: dict[str, asyncio.Event] = {}
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

    async def ready(self) -> tuple[bool, str]:
        role = "leader" if self.leader and self.leader.leading else "standby"
        return True, f"ready ({role})"

    async def _lead(self) -> None:
        assert self.leader is not None
        was = self.leader.leading
        if await self.leader.tick() and not was:
            log.info("remediator: leading with epoch %d", self.leader.epoch)
            await self._resume_open()

    # -- inputs ---------------------------------------------------------------------------
    async def _on_ack(self, msg: Any) -> None:
        try:
            ack = decode_durable(msg.data, CommandAck)
        except Exception:  # malformed acks are the sender's problem; ignore
            return
        self._acks.setdefault(ack.command_id, []).append(ack)
        event = self._ack_events.get(ack.command_id)
        if event is not None:
            event.set()

    async def on_anomaly(self, a: Anomaly, delivery: Delivery) -> None:
        if a.status == "resolved":
            self._resolved_anomalies.add(a.id)

    async def on_diagnosis(self, d: Diagnosis, delivery: Delivery) -> None:
        assert self.rt is not None and self.leader is not None
        if not self.leader.leading:
            raise Retry(delay=1.0, reason="not the leader")
        now = time.time()
        incidents = await self._open_incidents(d.job)
        with self.rt.tracer.start_as_current_span(
            f"decide {d.cause}", context=delivery.ctx,
            attributes={"trainguard.job": d.job, "trainguard.cause": d.cause,
                        "trainguard.hosts": ",".join(d.hosts),
                        "trainguard.ranks": ",".join(map(str, d.ranks))},
        ):
            inc = find_incident(incidents, d, self.policy.cooldown_s, now)
            replan = False
            if inc is None:
                if d.status == "superseded":
                    return  # its successor carries the story
                inc = open_incident(d, await self._detected_at(d), now)
                view = await self._view(d.job, d.cause, d.hosts)
                inc.failure_attempt = view.attempt
                await self.rt.redis.zadd(self.keys.cause_times(d.job, d.cause),
                                         {inc.id: now})
                replan = True
            else:
                replan = join(inc, d) and inc.status in ("open", "mitigating")
            if replan:
                view = await self._view(d.job, inc.cause, inc.hosts)
                steps, notes = plan(inc, d, self.policy, view, now)
                done = {(s["action"], json.dumps(s.get("params", {}), sort_keys=True))
                        for s in inc.actions if s.get("status") == "done"}
                kept = [s.as_dict() for s in steps
                        if (s.action, json.dumps(s.params, sort_keys=True)) not in done]
                inc.actions = [a for a in inc.actions if a.get("status") == "done"] + kept
                if notes:
                    inc.summary = f"{inc.summary} [{'; '.join(notes)}]".strip()
            await self._save(inc)
            self._run(inc)

    # -- incidents ------------------------------------------------------------------------
    async def _open_incidents(self, job: str) -> list[Incident]:
        assert self.rt is not None
        raw = await self.rt.redis.hgetall(self.keys.incidents(job))
        out = []
        for value in raw.values():
            inc = decode_durable(value.encode() if isinstance(value, str) else value, Incident)
            if inc.status in ("open", "mitigating"):
                out.append(inc)
        return out

    async def _save(self, inc: Incident, *, publish: bool = True) -> None:
        assert self.rt is not None and self.leader is not None
        if publish:
            inc.rev += 1
        is_open = inc.status in ("open", "mitigating")
        await self.leader.save_incident(self.keys.incidents(inc.job), inc.id,
                                        encode_durable(inc), self.keys.open_incidents(),
                                        f"{inc.job}|{inc.id}", is_open)
        if publish:
            await self.rt.publish_event(self.settings.subjects.event(inc.job, "incident"), inc)

    async def _resume_open(self) -> None:
        assert self.rt is not None
        for member in await self.rt.redis.smembers(self.keys.open_incidents()):
            job, _, ident = str(member).partition("|")
            raw = await self.rt.redis.hget(self.keys.incidents(job), ident)
            if raw:
                inc = decode_durable(raw.encode() if isinstance(raw, str) else raw, Incident)
                if inc.status in ("open", "mitigating"):
                    log.info("resuming incident %s of %s", inc.id, job)
                    self._run(inc)

    def _run(self, inc: Incident) -> None:
        assert self.rt is not None
        task = self._running.get(inc.id)
        if task is not None and not task.done():
            return
        self._running[inc.id] = self.rt.spawn(self._execute(inc.id, inc.job),
                                              f"incident:{inc.id}")

    async def _load(self, job: str, ident: str) -> Incident | None:
        assert self.rt is not None
        raw = await self.rt.redis.hget(self.keys.incidents(job), ident)
        return decode_durable(raw.encode() if isinstance(raw, str) else raw, Incident) \
            if raw else None

    async def _execute(self, ident: str, job: str) -> None:
        """Run the incident's pending steps in order, persisting after each."""
        assert self.rt is not None and self.leader is not None
        try:
            while self.leader.leading:
                inc = await self._load(job, ident)
                if inc is None or inc.status not in ("open", "mitigating"):
                    return
                pending = next((i for i, s in enumerate(inc.actions)
                                if s.get("status") in ("pending", "sent")), None)
                if pending is None:
                    if inc.mitigated_at is None and inc.actions:
                        inc.mitigated_at = time.time()
                        recovering = any(a.get("action") in ("restart", "rollback", "isolate")
                                         and a.get("status") in ("done", "skipped")
                                         for a in inc.actions)
                        if inc.escalation and not recovering:
                            inc.status = "escalated"  # nothing left that could recover it
                        await self._save(inc)
                    return
                step = Step.from_dict(inc.actions[pending])
                if step.action == "escalate" and step.params.get("grace") \
                        and not step.params.get("waited"):
                    # Give a better diagnosis (superseding this guess) a moment to arrive.
                    await asyncio.sleep(float(step.params["grace"]))
                    fresh = await self._load(job, ident)
                    if fresh is None or fresh.actions != inc.actions:
                        continue  # re-planned meanwhile: run the new plan
                    step.params["waited"] = True
                    fresh.actions[pending] = step.as_dict()
                    await self._save(fresh, publish=False)
                    continue
                if inc.first_action_at is None:
                    inc.first_action_at = time.time()
                    inc.status = "mitigating"

                async def persist(inc: Incident = inc, step: Step = step,
                                  index: int = pending) -> None:
                    # Before a command goes out: a successor must know it was sent.
                    inc.actions[index] = step.as_dict()
                    await self._save(inc, publish=False)

                await self._do(inc, step, persist)
                inc.actions[pending] = step.as_dict()
                if step.action == "escalate":
                    # A human is told; the steps that can still help (a restart in place)
                    # go on.
                    inc.escalation = step.detail
                elif step.status == "failed":
                    inc.status = "escalated"
                    inc.escalation = f"{step.action} failed: {step.detail}"
                await self._save(inc)
        except NotLeader:
            log.warning("lost leadership during incident %s", ident)

    async def _do(self, inc: Incident, step: Step,
                  persist: Callable[[], Awaitable[None]]) -> None:
        assert self.rt is not None
        step.at = time.time()
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
            except Exception as exc:
                step.status, step.detail = "failed", f"{type(exc).__name__}: {exc}"
            span.set_attribute("trainguard.outcome", step.status)
        await self.rt.publish_event(self.settings.subjects.event(inc.job, "action"), Action(
            id=uuid7(), job=inc.job, action=step.action, incident_id=inc.id,
            diagnosis_id=inc.diagnosis_ids[-1] if inc.diagnosis_ids else "",
            command_ids=step.command_ids, detail=step.detail, time=time.time(),
            status={"done": "acked", "failed": "failed", "skipped": "skipped"}.get(
                step.status, "sent")))  # type: ignore[arg-type]

    async def _dispatch(self, inc: Incident, step: Step,
                        persist: Callable[[], Awaitable[None]]) -> None:
        s = self.settings.subjects
        view = await self._view(inc.job, inc.cause, inc.hosts)
        match step.action:
            case "alert":
                step.status, step.detail = "done", f"alert: {inc.summary}"
            case "escalate":
                step.status = "done"
                step.detail = str(step.params.get("reason", "escalated to a human"))
            case "save_now":
                answer = await self._rpc(inc.job, "save",
                                         {"deadline": step.params.get("deadline", 60)},
                                         float(step.params.get("deadline", 60)) + 5)
                step.status = "done" if answer.get("ok") else "skipped"
                step.detail = answer.get("reason") or f"committed step {answer.get('step')}"
            case "rollback":
                answer = await self._rpc(inc.job, "rollback",
                                         {"below_step": step.params.get("below_step", 0)}, 10.0)
                if answer.get("step") is None:
                    step.status, step.detail = "failed", str(answer.get("reason",
                                                                        "no checkpoint"))
                else:
                    step.status, step.detail = "done", f"resume pointer at step {answer['step']}"
            case "dump":
                host = str(step.params["host"])
                await self._command(inc, step, "dump", s.cmd_host(inc.job, host), [host],
                                    {"ranks": step.params.get("ranks")}, persist)
            case "isolate":
                host = str(step.params["host"])
                assert self.leader is not None
                await self.leader.hset(self.keys.blocklist(), host, json.dumps({
                    "reason": inc.summary or inc.cause, "cause": inc.cause, "job": inc.job,
                    "incident": inc.id, "time": time.time()}))
                await self._command(inc, step, "isolate", s.cmd_host(inc.job, host), [host], {},
                                    persist)
                await self._note_restart(inc.job)
            case "restart":
                if inc.cause in CRASHING and inc.failure_attempt is not None:
                    # A dead worker: torchrun restarts the group by itself. Give it the
                    # chance rather than restarting a group that is already coming back.
                    deadline = time.monotonic() + self.policy.launcher_grace_s
                    while time.monotonic() < deadline and (
                            view.attempt is None or view.attempt <= inc.failure_attempt):
                        await asyncio.sleep(1.0)
                        view = await self._view(inc.job, inc.cause, inc.hosts)
                if inc.failure_attempt is not None and view.attempt is not None and \
                        view.attempt > inc.failure_attempt:
                    step.status = "skipped"
                    step.detail = (f"the launcher already restarted the workers (attempt "
                                   f"{view.attempt})")
                    inc.restarted_attempt = inc.failure_attempt
                    return
                inc.restarted_attempt = view.attempt
                await self._command(inc, step, "restart", s.cmd_all(inc.job),
                                    sorted(view.hosts), {}, persist)
                await self._note_restart(inc.job)
            case _:
                step.status, step.detail = "skipped", f"unknown action {step.action}"

    async def _note_restart(self, job: str) -> None:
        assert self.rt is not None
        await self.rt.redis.zadd(self.keys.restarts(job), {uuid7(): time.time()})

    async def _command(self, inc: Incident, step: Step, kind: str, subject: str,
                       hosts: list[str], params: dict[str, Any],
                       persist: Callable[[], Awaitable[None]]) -> None:
        """Send, await acks from ``hosts``; retry once, then fail (escalates)."""
        assert self.rt is not None and self.leader is not None
        previous = step.command_ids[-1] if step.command_ids else None
        for _ in range(2):
            ident = uuid7()
            cmd = Command(id=ident, job=inc.job, kind=kind, issuer="remediator",
                          epoch=self.leader.epoch, target=subject.rsplit(".cmd.", 1)[-1],
                          params={k: v for k, v in params.items() if v is not None},
                          issued_at=time.time(),
                          deadline=time.time() + self.policy.ack_timeout_s, retry_of=previous)
            step.command_ids.append(ident)
            step.status = "sent"
            await persist()
            self._ack_events[ident] = asyncio.Event()
            await self.rt.publish_event(subject, cmd)
            acks = await self._await_acks(ident, set(hosts), self.policy.ack_timeout_s)
            self._ack_events.pop(ident, None)
            if acks:
                outcomes = {a.responder: a.outcome for a in acks}
                bad = [a for a in acks if a.outcome not in ("done",)]
                step.detail = "; ".join(f"{a.responder}: {a.outcome} {a.detail[:200]}".strip()
                                        for a in acks)
                step.status = "failed" if bad and len(bad) == len(acks) else "done"
                if step.status == "done" or any(o == "refused" for o in outcomes.values()):
                    return
            previous = ident
        step.status = "failed"
        step.detail = step.detail or f"no acknowledgement of {kind} from {', '.join(hosts)}"

    async def _await_acks(self, ident: str, hosts: set[str], timeout: float) -> list[CommandAck]:
        deadline = time.monotonic() + timeout
        event = self._ack_events[ident]
        while True:
            acks = self._acks.get(ident, [])
            responders = {a.responder.removeprefix("host-") for a in acks}
            if acks and (not hosts or hosts <= responders):
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            event.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), min(remaining, 1.0))
        return list(self._acks.pop(ident, []))

    async def _rpc(self, job: str, name: str, body: dict[str, Any],
                   timeout: float) -> dict[str, Any]:
        assert self.rt is not None
        try:
            reply = await self.rt.bus.nc.request(self.settings.subjects.rpc(job, name),
                                                 json.dumps(body).encode(), timeout=timeout)
        except Exception as exc:
            return {"ok": False, "reason": f"no answer from the checkpoint coordinator ({exc!r})"}
        if not reply.data:
            return {"ok": False, "reason": "the coordinator has no checkpoint"}
        try:
            answer = json.loads(reply.data)
        except ValueError:
            return {"ok": False, "reason": "unreadable reply"}
        return answer if isinstance(answer, dict) else {"ok": False, "reason": str(answer)}

    # -- views and resolution --------------------------------------------------------------
    async def _detected_at(self, d: Diagnosis) -> float | None:
        # A revision of an older diagnosis opening a new incident: the failure is new.
        return d.time if d.rev == 1 and d.time else time.time()

    async def _view(self, job: str, cause: str, hosts: list[str]) -> JobView:
        assert self.rt is not None
        redis = self.rt.redis
        now = time.time()
        view = JobView()
        blocked = set(await redis.hkeys(self.keys.blocklist()))
        async for key in redis.scan_iter(match=self.keys.node(job, "*")):
            raw = await redis.get(key)
            if not raw:
                continue
            with contextlib.suppress(Exception):
                hello = json.loads(raw)
                if hello.get("host") not in blocked:
                    view.hosts[hello["host"]] = hello
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

    async def _watch(self) -> None:
        """Resolve incidents whose training passed the failure step; escalate stale ones."""
        assert self.rt is not None and self.leader is not None
        if not self.leader.leading:
            return
        now = time.time()
        for member in await self.rt.redis.smembers(self.keys.open_incidents()):
            job, _, ident = str(member).partition("|")
            inc = await self._load(job, ident)
            if inc is None or inc.status not in ("open", "mitigating"):
                continue
            task = self._running.get(ident)
            if task is not None and not task.done():
                continue
            view = await self._view(job, inc.cause, inc.hosts)
            restarting = any(a.get("action") in ("restart", "rollback", "isolate")
                             for a in inc.actions)
            if restarting and resolved_by_progress(inc, view, inc.restarted_attempt):
                inc.status, inc.resolved_at = "resolved", now
                if view.attempt is not None and inc.restarted_attempt is not None:
                    inc.resume_step = await self._resume_step(job)
                if inc.failure_step is not None and inc.resume_step is not None:
                    inc.steps_lost = max(0, inc.failure_step - inc.resume_step)
            elif not restarting and (set(inc.anomaly_ids) <= self._resolved_anomalies
                                     or (inc.mitigated_at is not None and not inc.anomaly_ids)):
                inc.status, inc.resolved_at = "resolved", now
            elif now - (inc.detected_at or now) > self.policy.resolve_timeout_s:
                inc.status = "escalated"
                inc.escalation = (f"not resolved within {self.policy.resolve_timeout_s:.0f}s "
                                  "of detection")
            else:
                continue
            try:
                await self._save(inc)
            except NotLeader:
                return

    async def _resume_step(self, job: str) -> int | None:
        """Where training resumed: the coordinator's resume pointer, if any."""
        answer = await self._rpc(job, "resume", {"job": job}, 2.0)
        step = answer.get("step")
        return int(step) if isinstance(step, int) else 0  # no checkpoint: from the start
