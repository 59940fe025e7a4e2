"""A straggler's cause, named from its host's readings: real NATS, the real diagnoser
service, and the agent's own link and host probe reading recorded fixtures (a loaded
/proc, a throttled nvidia-smi report, a sysfs tree with a degraded port)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_until
from tests.integration.diagnoses import diagnoser_settings, diagnoses
from tests.integration.recorder import running
from trainguard.agent.gpu import RecordedSource
from trainguard.agent.link import AgentLink
from trainguard.agent.node import LocalNode
from trainguard.agent.settings import AgentSettings
from trainguard.contract.evidence import StragglerEvidence
from trainguard.contract.schemas import Anomaly, NodeHello
from trainguard.contract.subjects import Subjects
from trainguard.runtime.bus import Bus
from trainguard.runtime.config import load_settings
from trainguard.services.diagnoser.service import DiagnoserService

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "health"


@pytest.mark.parametrize(("readings", "cause", "action", "fact"), [
    ({"proc_root": "proc/loaded"}, "straggler_cpu", ["alert"],
     "CPU contention on node-a: 1-minute load 37.84 on 4 CPUs"),
    ({"gpu_reading": "nvml/throttled.txt"}, "straggler_thermal", ["alert", "isolate"],
     "GPU 0 on node-a thermally throttled (hw_slowdown, hw_thermal_slowdown, 89.0 C, "
     "1095.0 MHz)"),
    ({"sysfs_root": "ib/degraded"}, "straggler_link", ["alert", "isolate"],
     "degraded link on node-a: port mlx5_1/1 runs at 100 Gb/sec (4X EDR), below 200 Gb/sec"),
])
async def test_a_stragglers_cause_comes_from_its_hosts_readings(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any,
        readings: dict[str, str], cause: str, action: list[str], fact: str) -> None:
    s = Subjects(prefix)
    quiet = {"proc_root": "proc/idle", "sysfs_root": "ib/healthy",
             "kernel_log": "kernel/clean.log"} | readings
    agent = load_settings(AgentSettings, env={}, overrides={
        "nats_url": nats_url, "redis_url": redis_url, "prefix": prefix, "job": job,
        "host": "node-a", "gpu_interval": 0.3, "node_interval": 60.0,
        **{k: str(FIX / v) for k, v in quiet.items()}})
    gpu = RecordedSource(agent.gpu_reading) if agent.gpu_reading else None
    node = LocalNode(agent, hosts_store=False, gpu=gpu, publish_exit=lambda _: None)
    got = await diagnoses(nc, s, job)
    svc = DiagnoserService(diagnoser_settings(nats_url, redis_url, prefix))
    async with running(svc):
        link = AgentLink(agent, node, NodeHello(job=job, host="node-a"))
        link.start()
        try:
            assert await asyncio.to_thread(link.ready.wait, 15.0), "agent link not ready"
            await wait_until(lambda: any(x.facts is not None for x in svc.rules.gpu["node-a"]),
                             timeout=15, what="the host probe's reading at the diagnoser")
            now = time.time()
            await Bus(nc, s, source="test").publish_durable(s.event(job, "anomaly"), Anomaly(
                id="slow-1", job=job, kind="straggler", ranks=[1], hosts=["node-a"],
                onset_at=now, detected_at=now, evidence=StragglerEvidence(ratio=1.8)))
            await wait_until(lambda: got, timeout=15, what="the straggler's diagnosis")
        finally:
            await asyncio.to_thread(link.close, 10.0)
    (d,) = got
    assert (d.cause, d.recommended, d.ranks, d.hosts) == (cause, action, [1], ["node-a"])
    assert any(e.fact.startswith(fact) for e in d.evidence), [e.fact for e in d.evidence]
    assert fact in d.summary
