"""The agent's node heartbeat follows its ranks' process states as they change.

A frozen rank (SIGSTOP) is a hang the detector names from the node heartbeat alone, so a
beat only every ``node_interval`` would make the detection wait for it. Here the interval
is a minute and each change (frozen, thawed, gone) must still reach the bus long before.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from typing import Any

from tests.conftest import wait_until
from trainguard.agent.gpu import ScriptedSource
from trainguard.agent.link import AgentLink
from trainguard.agent.node import LocalNode, Worker
from trainguard.agent.settings import AgentSettings
from trainguard.contract.codec import decode_telemetry
from trainguard.contract.schemas import GpuSample, NodeHeartbeat, NodeHello
from trainguard.contract.subjects import Subjects
from trainguard.runtime.config import load_settings

WAIT = 15.0
"""Far below the test's ``node_interval``: only an at-once beat arrives within it."""


async def test_a_frozen_thawed_and_dead_rank_is_beaten_about_at_once(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any) -> None:
    s = Subjects(prefix)
    settings = load_settings(AgentSettings, env={}, overrides={
        "nats_url": nats_url, "redis_url": redis_url, "prefix": prefix, "job": job,
        "host": "node-a", "node_interval": 60.0, "gpu_interval": 60.0})
    node = LocalNode(settings, hosts_store=False, gpu=None, publish_exit=lambda _: None)
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    node.workers_started([Worker(rank=0, local_rank=0, pid=rank.pid, stderr=None)], 0)
    beats: list[NodeHeartbeat] = []

    async def on_beat(msg: Any) -> None:
        beat = decode_telemetry(msg.data)
        assert isinstance(beat, NodeHeartbeat)
        beats.append(beat)

    await nc.subscribe(s.node(job, "node-a"), cb=on_beat)
    link = AgentLink(settings, node, NodeHello(job=job, host="node-a"))
    link.start()
    try:
        assert await asyncio.to_thread(link.ready.wait, WAIT), "agent link not ready"

        async def beaten(letters: set[str], what: str) -> None:
            await wait_until(lambda: bool(beats) and beats[-1].ranks.get(0) in letters,
                             timeout=WAIT, what=what)

        await beaten({"S", "R"}, "a first beat of the running rank")
        first = len(beats)
        rank.send_signal(signal.SIGSTOP)
        await beaten({"T"}, "a beat of the frozen rank")
        rank.send_signal(signal.SIGCONT)
        await beaten({"S", "R"}, "a beat of the thawed rank")
        rank.kill()
        rank.wait()
        await beaten({"X", "Z"}, "a beat of the dead rank")
        # One beat per change, not one per look at the states.
        assert len(beats) - first == 3, [b.ranks for b in beats]
    finally:
        await asyncio.to_thread(link.close, 10.0)
        if rank.poll() is None:
            rank.kill()
            rank.wait()


async def test_a_gpu_fault_is_sent_at_once_not_at_the_next_sample(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any) -> None:
    """Samples every minute, looks every 0.2 s: an XID and a rising uncorrectable ECC count
    each go out long before the next sample (that a quiet look sends nothing is the rule's
    own test, tests/unit/test_gpu_alarm.py)."""
    s = Subjects(prefix)
    settings = load_settings(AgentSettings, env={}, overrides={
        "nats_url": nats_url, "redis_url": redis_url, "prefix": prefix, "job": job,
        "host": "node-a", "node_interval": 60.0, "gpu_interval": 60.0,
        "gpu_look_interval": 0.2})
    gpu = ScriptedSource(gpus=2)
    node = LocalNode(settings, hosts_store=False, gpu=gpu, publish_exit=lambda _: None)
    samples: list[GpuSample] = []

    async def on_sample(msg: Any) -> None:
        sample = decode_telemetry(msg.data)
        assert isinstance(sample, GpuSample)
        samples.append(sample)

    await nc.subscribe(s.gpu(job, "node-a"), cb=on_sample)
    link = AgentLink(settings, node, NodeHello(job=job, host="node-a"))
    link.start()
    try:
        assert await asyncio.to_thread(link.ready.wait, WAIT), "agent link not ready"
        await wait_until(lambda: len(samples) == 1, timeout=WAIT, what="the first sample")
        gpu.inject_xid(79, gpu=1)
        await wait_until(lambda: len(samples) == 2, timeout=WAIT, what="the XID sent at once")
        assert [(x.gpu, x.code) for x in samples[1].xids] == [(1, 79)]
        gpu.inject_ecc(gpu=0, count=2)
        await wait_until(lambda: len(samples) == 3, timeout=WAIT, what="the ECC count sent")
        assert samples[2].gpus[0].ecc_uncorrected_volatile == 2 and not samples[2].xids
    finally:
        await asyncio.to_thread(link.close, 10.0)
