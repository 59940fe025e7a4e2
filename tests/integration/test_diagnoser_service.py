"""The diagnoser service on real NATS and Redis."""

from __future__ import annotations

import time
from typing import Any

import redis.asyncio as aioredis

from tests.conftest import wait_until
from tests.integration.diagnoses import diagnoser_settings, diagnoses
from tests.integration.recorder import running
from trainguard.contract.codec import decode_durable, encode_telemetry
from trainguard.contract.evidence import CrashEvidence, HangEvidence
from trainguard.contract.schemas import Anomaly, DeadLetter, GpuSample, WorkerExit, XidEvent
from trainguard.contract.subjects import Subjects
from trainguard.runtime.bus import Bus
from trainguard.runtime.state import Keys
from trainguard.services.diagnoser.service import DiagnoserService


async def test_exit_and_crash_become_one_diagnosis(nats_url: str, redis_url: str, prefix: str,
                                                   job: str, nc: Any) -> None:
    s = Subjects(prefix)
    settings = diagnoser_settings(nats_url, redis_url, prefix)
    got = await diagnoses(nc, s, job)
    dead: list[DeadLetter] = []

    async def on_dead(msg: Any) -> None:
        dead.append(decode_durable(msg.data, DeadLetter))

    await nc.subscribe(s.dead(job), cb=on_dead)
    svc = DiagnoserService(settings)
    async with running(svc):
        bus = Bus(nc, s, source="test")
        now = time.time()
        sample = encode_telemetry(GpuSample(
            job=job, time=now, host="node-b", xids=[XidEvent(gpu=0, code=79, time=now)]))

        async def seen() -> object:
            # Telemetry is fire-and-forget, as from an agent sampling every few seconds: a
            # sample sent before the subscription reached the server is simply resent.
            await nc.publish(s.gpu(job, "node-b"), sample)
            return svc.rules.gpu.get("node-b")

        await wait_until(seen, timeout=30, interval=0.2, what="the GPU sample seen")
        await bus.publish_durable(s.exit(job, "node-b"), WorkerExit(
            id="x1", job=job, host="node-b", rank=3, exit_code=1, time=now,
            stderr_tail="RuntimeError: CUDA error: unknown error"))
        await bus.publish_durable(s.event(job, "anomaly"), Anomaly(
            id="crash-3", job=job, kind="crash", ranks=[3], hosts=["node-b"], onset_at=now,
            detected_at=now, evidence=CrashEvidence(
                stderr_tail="RuntimeError: CUDA error: unknown error", exit_code=1)))
        await wait_until(lambda: got, what="a diagnosis")
        await bus.publish_durable(s.event(job, "anomaly"), Anomaly(
            id="hang-1", job=job, kind="hang", ranks=[0, 1, 2], hosts=["node-a", "node-b"],
            onset_at=now, detected_at=now + 1, evidence=HangEvidence(culprits=[],
                                                                     majority_phase="comm")))
        await nc.jetstream().publish(s.event(job, "anomaly"), b'{"kind": 7}',
                                     headers={"ce-type": "io.trainguard.anomaly.v1"})
        await wait_until(lambda: len(got) == 2 and dead, what="the join and a dead letter")
    first, joined = got
    assert first.cause == "gpu_lost" and first.hosts == ["node-b"] and first.ranks == [3]
    assert any("XID 79" in e.fact for e in first.evidence)
    assert joined.id == first.id and joined.anomaly_ids == ["crash-3", "hang-1"]
    assert "invalid anomaly" in dead[0].reason
    r = aioredis.Redis.from_url(redis_url, decode_responses=True)
    hist = await r.hgetall(Keys(prefix).host_history("node-b"))
    await r.aclose()
    assert hist["gpu_lost"] == "1" and hist["last_cause"] == "gpu_lost"


async def test_a_throughput_drop_while_a_rank_straggles_joins_the_straggler(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any) -> None:
    """Issue 16: the drop a straggler causes is its collateral, never an ``unknown`` of its
    own (which would page a human); once the straggler is resolved, a drop is judged alone.
    The service follows the resolution from the anomaly stream itself."""
    import msgspec

    from trainguard.contract.evidence import StragglerEvidence, ThroughputDropEvidence

    s = Subjects(prefix)
    settings = diagnoser_settings(nats_url, redis_url, prefix)
    got = await diagnoses(nc, s, job)

    async with running(DiagnoserService(settings)):
        bus = Bus(nc, s, source="test")
        now = time.time()
        slow = Anomaly(id="slow-1", job=job, kind="straggler", ranks=[1], hosts=["node-a"],
                       onset_at=now, detected_at=now, evidence=StragglerEvidence(ratio=2.5))
        await bus.publish_durable(s.event(job, "anomaly"), slow)
        await wait_until(lambda: got, what="the straggler's diagnosis")

        def drop(ident: str) -> Anomaly:
            return Anomaly(id=ident, job=job, kind="throughput_drop", ranks=[0, 1, 2, 3],
                           hosts=["node-a", "node-b"], onset_at=now, detected_at=now + 0.3,
                           evidence=ThroughputDropEvidence(baseline=100.0, recent=40.0))

        await bus.publish_durable(s.event(job, "anomaly"), drop("drop-1"))
        await wait_until(lambda: len(got) == 2, what="the straggler's revision")
        await bus.publish_durable(s.event(job, "anomaly"),
                                  msgspec.structs.replace(slow, status="resolved", rev=2))
        await bus.publish_durable(s.event(job, "anomaly"), drop("drop-2"))
        await wait_until(lambda: len(got) == 3, what="a diagnosis of the later drop")
    first, joined, alone = got
    assert first.cause == "straggler"
    assert joined.id == first.id and joined.rev == 2 and joined.collateral == ["drop-1"]
    assert joined.cause == "straggler" and joined.ranks == [1]
    assert alone.id != first.id and alone.cause == "unknown" and alone.collateral == []
