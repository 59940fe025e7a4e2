"""The detector service through real nats-server and redis-server.

Synthetic ranks publish hellos (JetStream) and telemetry (core NATS) exactly as the client
will; the tests assert what arrives on ``tg.<job>.event.anomaly`` and in Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import nats
import nats.errors
import redis.asyncio as aioredis

from tests.conftest import wait_until
from tests.integration.recorder import running
from trainguard.contract.codec import decode_durable
from trainguard.contract.schemas import Anomaly, Heartbeat, RankHello, StepReport, WorkerExit
from trainguard.contract.subjects import Subjects
from trainguard.core.connection import flush
from trainguard.runtime.bus import Bus
from trainguard.runtime.config import load_settings
from trainguard.runtime.embedded import NatsServer
from trainguard.runtime.state import Keys, decode_progress
from trainguard.services.detector.service import DetectorService
from trainguard.services.detector.settings import DetectorSettings

WAIT = 60.0
"""Generous: the servers share a busy machine, where an fsync stall can last seconds."""


def until(cond: Callable[[], Any], what: str) -> Awaitable[Any]:
    return wait_until(cond, timeout=WAIT, what=what)


def settings(nats_url: str, redis_url: str, prefix: str, **extra: object) -> DetectorSettings:
    return load_settings(DetectorSettings, env={}, overrides={
        "nats_url": nats_url, "redis_url": redis_url, "prefix": prefix,
        "tick_interval": 0.1, "progress_interval": 0.2, "lease_interval": 0.2,
        "lease_ttl": 1.5, "hb_timeout": 2.0, "hang_floor": 2.0, "retry_delay": 0.2,
        "bus_probe_interval": 0.1, "bus_stale_after": 0.8, **extra})


class FakeJob:
    """Ranks of a job, publishing like the trainer client: hellos, beats, step reports."""

    def __init__(self, bus: Bus, job: str, ranks: int = 4, per_host: int = 2) -> None:
        self.bus = bus
        self.s = bus.subjects
        self.job = job
        self.ranks = list(range(ranks))
        self.per_host = per_host
        self.step = 0
        self.phase = dict.fromkeys(self.ranks, "compute")
        self.since = dict.fromkeys(self.ranks, time.time())
        self.beating = set(self.ranks)
        self.seq = 0

    def host(self, rank: int) -> str:
        return f"host-{rank // self.per_host}"

    async def hello(self) -> None:
        for r in self.ranks:
            await self.bus.publish_durable(self.s.reg_rank(self.job, r), RankHello(
                job=self.job, rank=r, world_size=len(self.ranks), local_rank=r % self.per_host,
                host=self.host(r), time=time.time()))

    def set_phase(self, rank: int, phase: str) -> None:
        if self.phase[rank] != phase:
            self.phase[rank] = phase
            self.since[rank] = time.time()

    async def beat(self) -> None:
        if not self.bus.connected:
            return  # like the client: telemetry is dropped, never queued for long
        now = time.time()
        for r in sorted(self.beating):
            self.seq += 1
            await self.bus.publish_telemetry(self.s.hb(self.job, r), Heartbeat(
                job=self.job, time=now, seq=self.seq, rank=r, host=self.host(r),
                step=self.step, phase=self.phase[r], phase_elapsed=now - self.since[r]))

    async def steps(self, n: int, seconds: float = 0.05) -> None:
        for _ in range(n):
            await asyncio.sleep(seconds)  # the step's work
            now = time.time()
            if not self.bus.connected:
                self.step += 1
                continue
            for r in self.ranks:
                self.seq += 1
                await self.bus.publish_telemetry(self.s.step(self.job, r), StepReport(
                    job=self.job, time=now, seq=self.seq, rank=r, step=self.step,
                    duration=seconds, phases={"data": 0.002, "compute": seconds * 0.8,
                                              "comm": seconds * 0.2 - 0.002},
                    loss=2.0, grad_norm=1.0, tokens=1024))
            self.step += 1
            await self.beat()

    @contextlib.asynccontextmanager
    async def beating_in_background(self, every: float = 0.1,
                                    stepping: bool = False) -> AsyncIterator[None]:
        """Heartbeats (and, if ``stepping``, steps) until the block ends."""
        async def loop() -> None:
            while True:
                if stepping:
                    await self.steps(1)
                else:
                    await self.beat()
                    await asyncio.sleep(every)

        task = asyncio.create_task(loop())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def anomalies(nc: Any, subjects: Subjects, job: str = "*") -> list[Anomaly]:
    """Every anomaly published from now on (core subscription to the event subject)."""
    seen: list[Anomaly] = []

    async def cb(msg: Any) -> None:
        seen.append(decode_durable(msg.data, Anomaly))

    await nc.subscribe(subjects.pattern("event", job=job, tail="anomaly"), cb=cb)
    await flush(nc)
    return seen


async def progress_of(redis_url: str, prefix: str, job: str) -> Any:
    r = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        raw = await r.get(Keys(prefix).progress(job))
        return decode_progress(raw) if raw else None
    finally:
        await r.aclose()


def of(seen: list[Anomaly], kind: str, status: str = "open") -> list[Anomaly]:
    return [a for a in seen if a.kind == kind and a.status == status]


@contextlib.asynccontextmanager
async def detecting(svc: DetectorService, nc: Any,
                    job: str) -> AsyncIterator[tuple[FakeJob, list[Anomaly]]]:
    """``svc`` running and owning ``job``, whose ranks (on ``nc``) have said hello; and
    every anomaly it publishes from now on."""
    subjects = svc.settings.subjects
    seen = await anomalies(nc, subjects, job)
    async with running(svc):
        ranks = FakeJob(Bus(nc, subjects, source="test"), job)
        await ranks.hello()
        await until(lambda: job in svc.owned, what="the detector to take the job")
        yield ranks, seen


async def test_hang_arrives_on_the_event_subject_naming_the_culprit_then_resolves(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any) -> None:
    svc = DetectorService(settings(nats_url, redis_url, prefix))
    async with detecting(svc, nc, job) as (ranks, seen), ranks.beating_in_background():
        await ranks.steps(30)
        p = await until(lambda: progress_of(redis_url, prefix, job), what="progress")
        assert p.world_size == 4 and set(p.ranks) == {0, 1, 2, 3}
        await until(lambda: _progress_step(redis_url, prefix, job, 29),
                    what="progress to reach step 29")
        # Rank 2 stops in its data loader; the others wait for it in the collective.
        for r in ranks.ranks:
            ranks.set_phase(r, "data" if r == 2 else "comm")
        await until(lambda: of(seen, "hang"), what="a hang anomaly")
        [hang] = of(seen, "hang")
        assert hang.job == job and hang.ranks == [2] and hang.hosts == ["host-1"]
        assert hang.evidence.culprits == [2] and hang.evidence.majority_phase == "comm"
        assert hang.evidence.phases["2"].phase == "data"
        assert hang.step == 29 and hang.schema == "io.trainguard.anomaly.v1"
        p = await until(lambda: _progress_state(redis_url, prefix, job, 2, "hung"),
                        what="progress to show rank 2 hung")
        for r in ranks.ranks:
            ranks.set_phase(r, "compute")
        await ranks.steps(3)
        await until(lambda: of(seen, "hang", "resolved"),
                    what="the hang to resolve")
    [resolved] = of(seen, "hang", "resolved")
    assert (resolved.id, resolved.rev) == (hang.id, 2)
    assert len(of(seen, "hang")) == 1, "one anomaly per onset"


async def _progress_step(redis_url: str, prefix: str, job: str, step: int) -> bool:
    p = await progress_of(redis_url, prefix, job)
    return p is not None and p.last_step == step


async def _progress_state(redis_url: str, prefix: str, job: str, rank: int, state: str) -> Any:
    p = await progress_of(redis_url, prefix, job)
    return p if p is not None and p.ranks[rank].state == state else None


def worker_exit(job: str, rank: int, ident: str, **kw: Any) -> WorkerExit:
    return WorkerExit(id=ident, job=job, host=f"host-{rank // 2}", rank=rank,
                      time=time.time(), **kw)


async def test_worker_exit_is_a_crash_unless_a_command_initiated_it(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any) -> None:
    svc = DetectorService(settings(nats_url, redis_url, prefix))
    subjects = Subjects(prefix)
    seen = await anomalies(nc, subjects, job)
    async with running(svc):
        bus = Bus(nc, subjects, source="test")
        await FakeJob(bus, job).hello()
        await bus.publish_durable(subjects.exit(job, "host-0"), worker_exit(
            job, 0, "x0", exit_code=143, initiated_by="launcher"))
        await bus.publish_durable(subjects.exit(job, "host-1"), worker_exit(
            job, 3, "x1", exit_code=1, error="RuntimeError: CUDA error: an illegal memory "
            "access was encountered"))
        await until(lambda: of(seen, "crash"), what="a crash anomaly")
    [crash] = of(seen, "crash")
    assert crash.ranks == [3] and crash.hosts == ["host-1"] and crash.severity == "critical"
    assert crash.evidence.exit_code == 1 and "illegal memory" in crash.evidence.error
    assert crash.detected_at >= crash.onset_at


async def test_heartbeat_silence_is_unresponsive_naming_the_rank(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any) -> None:
    svc = DetectorService(settings(nats_url, redis_url, prefix))
    async with detecting(svc, nc, job) as (ranks, seen), ranks.beating_in_background():
        await ranks.steps(10)
        ranks.beating.discard(1)
        await until(lambda: of(seen, "unresponsive"),
                    what="an unresponsive anomaly")
        [alert] = of(seen, "unresponsive")
        assert alert.ranks == [1] and alert.hosts == ["host-0"]
        assert not of(seen, "crash"), "silence alone is never a crash"
        ranks.beating.add(1)
        await until(lambda: of(seen, "unresponsive", "resolved"),
                    what="beats to resolve it")


async def test_a_restarted_detector_does_not_alert_again_and_resolves_the_same_anomaly(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any) -> None:
    subjects = Subjects(prefix)
    seen = await anomalies(nc, subjects, job)
    ranks = FakeJob(Bus(nc, subjects, source="test"), job)
    first = DetectorService(settings(nats_url, redis_url, prefix, instance_id="det-1"))
    async with ranks.beating_in_background():
        async with running(first):
            await ranks.hello()
            await until(lambda: job in first.owned, what="the first detector to own it")
            await ranks.steps(20)
            for r in ranks.ranks:
                ranks.set_phase(r, "data" if r == 0 else "comm")
            await until(lambda: of(seen, "hang"), what="a hang anomaly")
        second = DetectorService(settings(nats_url, redis_url, prefix, instance_id="det-2"))
        started = time.time()
        async with running(second):
            await until(lambda: job in second.owned,
                        what="the second detector to take the job over")
            # Past its takeover grace, the second detector has judged the ongoing hang.
            await until(lambda: _progress_after(redis_url, prefix, job, started + 3.0),
                        what="the second detector to judge the job")
            assert len(of(seen, "hang")) == 1, "the restart raised the open hang again"
            assert second.detector.jobs[job].book.is_open("hang")
            for r in ranks.ranks:
                ranks.set_phase(r, "compute")
            await ranks.steps(3)
            await until(lambda: of(seen, "hang", "resolved"),
                        what="the hang to resolve")
    [hang] = of(seen, "hang")
    [resolved] = of(seen, "hang", "resolved")
    assert (resolved.id, resolved.rev) == (hang.id, 2)


async def _progress_after(redis_url: str, prefix: str, job: str, after: float) -> bool:
    p = await progress_of(redis_url, prefix, job)
    return p is not None and p.time > after


async def every_rank_ok_after_the_grace(redis_url: str, prefix: str, job: str,
                                        hb_timeout: float) -> None:
    """Once past the grace that follows a bus outage, the detector judges every rank alive."""
    back = time.time()
    await until(lambda: _progress_after(redis_url, prefix, job, back + hb_timeout + 1.0),
                what="progress written after the grace")
    p = await progress_of(redis_url, prefix, job)
    assert {r.state for r in p.ranks.values()} == {"ok"}


async def stored_anomalies(js: Any, subject: str) -> list[Anomaly]:
    """Every anomaly the events stream holds on ``subject`` (a late subscriber misses none)."""
    sub = await js.pull_subscribe(subject, durable=None)
    found: list[Anomaly] = []
    try:
        while True:
            try:
                msgs = await sub.fetch(100, timeout=1.0)
            except (TimeoutError, nats.errors.TimeoutError):
                return found
            for msg in msgs:
                found.append(decode_durable(msg.data, Anomaly))
                await msg.ack()
    finally:
        await sub.unsubscribe()


async def test_no_silence_judgement_right_after_the_detectors_reconnect(
        private_nats: NatsServer, redis_url: str, prefix: str, job: str) -> None:
    svc = DetectorService(settings(private_nats.url, redis_url, prefix))
    subjects = Subjects(prefix)
    # The ranks come back a little after the detector: it must not call them silent then.
    pub = await nats.connect(private_nats.url, max_reconnect_attempts=-1,
                             reconnect_time_wait=1.5)
    try:
        async with running(svc) as rt:
            ranks = FakeJob(Bus(pub, subjects, source="test"), job)
            await ranks.hello()
            await until(lambda: job in svc.owned, what="the detector to take the job")
            async with ranks.beating_in_background(stepping=True):
                reconnects = rt.bus.nc.stats["reconnects"]
                private_nats.kill()
                await until(lambda: not rt.bus.connected, what="the detector to see the outage")
                await asyncio.sleep(2 * svc.cfg.hb_timeout)  # an outage longer than hb_timeout
                private_nats.start()
                await until(lambda: rt.bus.nc.stats["reconnects"] > reconnects
                            and pub.is_connected, what="both to reconnect")
                await every_rank_ok_after_the_grace(redis_url, prefix, job, svc.cfg.hb_timeout)
        stored = await stored_anomalies(pub.jetstream(), subjects.event(job, "anomaly"))
        assert [a.kind for a in stored] == []
    finally:
        await pub.close()
