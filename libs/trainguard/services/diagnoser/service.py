"""The diagnoser's async shell: anomalies, exits and GPU samples in; diagnoses out."""

from __future__ import annotations

import time
from collections.abc import Sequence

from trainguard.contract.errors import Retry
from trainguard.contract.schemas import (
    Anomaly,
    FlightRecorderReport,
    GpuSample,
    TelemetryMessage,
    WorkerExit,
)
from trainguard.runtime.domains import load_topology
from trainguard.runtime.service import Consumer, Delivery, Runtime, Service
from trainguard.runtime.state import Keys
from trainguard.runtime.topology import ConsumerSpec

from .flightrec import FlightRecorder
from .rules import Diagnoser, HostRecord
from .settings import DiagnoserSettings


class DiagnoserService(Service[DiagnoserSettings]):
    name = "diagnoser"
    settings_type = DiagnoserSettings

    def __init__(self, settings: DiagnoserSettings) -> None:
        super().__init__(settings)
        self.rules = Diagnoser(window=settings.correlation_window,
                               gpu_window=settings.gpu_window,
                               same_cause_window=settings.same_cause_window,
                               symptom_window=settings.symptom_window,
                               steal_pct=settings.straggler_steal_pct,
                               load_ratio=settings.straggler_load_ratio,
                               domain_window=settings.domain_window,
                               burst_window=settings.burst_window,
                               topology=load_topology(settings.topology, settings.label_keys))
        self.keys = Keys(settings.prefix)
        self.flight_recorder = FlightRecorder(settings.correlation_window)

    def consumers(self) -> Sequence[Consumer]:
        s = self.settings.subjects
        return [
            Consumer(ConsumerSpec("reports", "diagnoser-exits", (s.pattern("exit"),)),
                     self.on_exit, (WorkerExit,)),
            Consumer(ConsumerSpec("events", "diagnoser", (s.pattern("event", tail="anomaly"),)),
                     self.on_anomaly, (Anomaly,)),
            Consumer(ConsumerSpec("reports", "diagnoser-fr", (s.pattern("fr"),)),
                     self.on_flight_recorder, (FlightRecorderReport,)),
        ]

    async def start(self, rt: Runtime) -> None:
        await rt.subscribe_telemetry(self.settings.subjects.pattern("gpu"), self.on_gpu)

    def on_gpu(self, msg: TelemetryMessage, subject: str) -> None:
        if isinstance(msg, GpuSample):
            self.rules.observe_gpu(msg)

    async def on_exit(self, ex: WorkerExit, delivery: Delivery) -> None:
        self.rules.observe_exit(ex)

    async def on_flight_recorder(self, report: FlightRecorderReport,
                                 delivery: Delivery) -> None:
        """Dumps the agents collected on ``dump``: the culprits of the open hang."""
        decision = self.flight_recorder.on_report(self.rules, report, time.time())
        subject = self.settings.subjects.event(report.job, "diagnosis")
        for d in decision.publish:
            await self.runtime.publish_event(subject, d, ctx=delivery.ctx)

    async def on_anomaly(self, a: Anomaly, delivery: Delivery) -> None:
        redis = self.runtime.redis
        dedupe = self.keys.dedupe("diagnoser", a.job)
        # Every transition counts: which failures are still open decides what a later
        # symptom joins (causality.py), even for an anomaly diagnosed already.
        self.rules.follow(a)
        if a.status == "resolved" or await redis.hexists(dedupe, a.id):
            return
        history: dict[str, HostRecord] = {}
        for host in a.hosts:
            raw = await redis.hgetall(self.keys.host_history(host))
            history[host] = HostRecord({str(k): int(v) for k, v in raw.items()
                                        if str(v).isdigit()})
        decision = self.rules.on_anomaly(a, time.time(), history)
        if decision.wait:  # a host's silence waits for the rest of its failure domain
            raise Retry(delay=decision.wait, reason="waiting for the hosts lost with it")
        subject = self.settings.subjects.event(a.job, "diagnosis")
        for d in decision.publish:
            await self.runtime.publish_event(subject, d, ctx=delivery.ctx)
        fresh = [d for d in decision.publish if d.rev == 1]
        async with redis.pipeline(transaction=True) as pipe:
            for d in fresh:
                for host in d.hosts:
                    key = self.keys.host_history(host)
                    pipe.hincrby(key, d.cause, 1)
                    pipe.hset(key, mapping={"last_cause": d.cause, "last_time": str(d.time)})
            pipe.hset(dedupe, a.id, decision.publish[-1].id if decision.publish else "")
            pipe.expire(dedupe, int(self.settings.dedupe_ttl))
            await pipe.execute()
