"""A node that fails its pre-flight is blocklisted, with the failed check as the reason,
by the remediator's policy before any rank starts; a healthy node starts its ranks.
Real NATS and Redis, the real remediator, ``trainguard launch`` as a user runs it, its
host's InfiniBand ports read from recorded sysfs trees."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from tests.conftest import wait_until
from tests.integration.recorder import running
from trainguard.contract.codec import decode_durable
from trainguard.contract.schemas import Action, PreflightReport
from trainguard.contract.subjects import Subjects
from trainguard.runtime.config import load_settings
from trainguard.runtime.state import Keys, decode_blocklist_entry
from trainguard.services.remediator.service import RemediatorService
from trainguard.services.remediator.settings import RemediatorSettings

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "health"
TRAINER = "import pathlib, sys; pathlib.Path(sys.argv[1]).write_text('ran')\n"


def launch(host: str, sysfs: str, marker: Path, nats_url: str, redis_url: str, prefix: str,
           job: str, tmp: Path) -> subprocess.Popen[str]:
    script = tmp / "trainer.py"
    script.write_text(TRAINER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env.update({"TRAINGUARD_SYSFS_ROOT": str(FIX / "ib" / sysfs),
                "TRAINGUARD_KERNEL_LOG": str(FIX / "kernel" / "clean.log"),
                "TRAINGUARD_PREFLIGHT_CHECKS": "nvml,ib",
                "TRAINGUARD_PREFLIGHT_VERDICT_WAIT": "30",
                "TRAINGUARD_LOG_ROOT": str(tmp / "logs"), "GLOO_SOCKET_IFNAME": "lo"})
    cmd = [sys.executable, "-m", "trainguard", "launch", "--job", job, "--host", host,
           "--nats", nats_url, "--redis", redis_url, "--prefix", prefix, "--warm-spares", "0",
           "--nproc-per-node", "1", "--local-addr", "127.0.0.1", "--", str(script),
           str(marker)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


async def test_a_node_failing_preflight_is_blocklisted_before_its_ranks_start(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any,
        tmp_path: Path) -> None:
    s = Subjects(prefix)
    records: list[PreflightReport] = []
    actions: list[Action] = []

    async def on_record(msg: Any) -> None:
        records.append(decode_durable(msg.data, PreflightReport))

    async def on_action(msg: Any) -> None:
        actions.append(decode_durable(msg.data, Action))

    await nc.subscribe(s.event(job, "preflight"), cb=on_record)
    await nc.subscribe(s.event(job, "action"), cb=on_action)
    settings = load_settings(RemediatorSettings, env={}, overrides={
        "nats_url": nats_url, "redis_url": redis_url, "prefix": prefix, "lease_ttl": 1.0})
    svc = RemediatorService(settings)
    r = aioredis.Redis.from_url(redis_url)
    try:
        async with running(svc):
            await wait_until(lambda: svc.leader is not None and svc.leader.leading,
                             timeout=15, what="the remediator leading")
            bad_marker, good_marker = tmp_path / "bad-ran", tmp_path / "good-ran"
            bad = launch("node-bad", "degraded", bad_marker, nats_url, redis_url, prefix, job,
                         tmp_path)
            out, _ = await asyncio.to_thread(bad.communicate, timeout=120)
            assert bad.returncode == 200, out
            assert not bad_marker.exists(), "a rank started on the failed node"
            assert "blocklisted: preflight failed on node-bad: ib:mlx5_1/1: port mlx5_1/1 " \
                   "runs at 100 Gb/sec (4X EDR), below 200 Gb/sec" in out, out
            raw = await r.hget(Keys(prefix).blocklist(), "node-bad")
            assert raw is not None
            entry = decode_blocklist_entry(raw)
            assert (entry.cause, entry.job) == ("preflight", job)
            assert "ib:mlx5_1/1" in entry.reason and entry.expires > entry.time
            await wait_until(lambda: actions, timeout=10, what="the action event")
            assert actions[0].action == "isolate" and "node-bad" in actions[0].detail

            good = launch("node-good", "healthy", good_marker, nats_url, redis_url, prefix,
                          job, tmp_path)
            out, _ = await asyncio.to_thread(good.communicate, timeout=120)
            assert good.returncode == 0, out
            assert good_marker.read_text() == "ran"
            assert await r.hget(Keys(prefix).blocklist(), "node-good") is None
            registry = svc.runtime.metrics.registry
            await wait_until(lambda: registry.get_sample_value(
                "trainguard_preflight_nodes_total", {"status": "ok", "trigger": "launch"}),
                timeout=10, what="the healthy node's record counted")
            assert registry.get_sample_value(
                "trainguard_preflight_nodes_total", {"status": "fail", "trigger": "launch"}) == 1
            assert registry.get_sample_value(
                "trainguard_preflight_checks_total", {"check": "ib", "status": "fail"}) == 1
    finally:
        await r.aclose()
    by_host = {rec.host: rec for rec in records}
    assert by_host["node-bad"].status == "fail" and by_host["node-good"].status == "ok"
    assert by_host["node-bad"].trigger == "launch"
    assert [c.name for c in by_host["node-bad"].failed()] == ["ib:mlx5_1/1"]
