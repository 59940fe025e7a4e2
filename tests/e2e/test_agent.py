"""``trainguard launch`` with real torchrun gloo jobs: exits, restarts, drills, isolation."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import nats
import redis.asyncio as aioredis

from tests.conftest import wait_until
from tests.e2e.conftest import job_env, launch
from tests.tap import Tap, tapped
from trainguard.agent.exitcodes import EXIT_ISOLATED, EXIT_STOPPED
from trainguard.contract.schemas import (
    Command,
    GpuSample,
    Heartbeat,
    NodeHeartbeat,
    RankHello,
    StepReport,
)
from trainguard.contract.subjects import Subjects
from trainguard.runtime.embedded import free_port
from trainguard.runtime.fencing import Epochs
from trainguard.runtime.state import Keys


def env_for(nats_url: str, redis_url: str, prefix: str) -> dict[str, str]:
    return job_env(nats_url, prefix, TRAINGUARD_REDIS_URL=redis_url)


async def exit_code(proc: subprocess.Popen[bytes], timeout: float = 150) -> int:
    return await asyncio.to_thread(proc.wait, timeout)


def pids_seen(tap: Tap, host: str) -> list[frozenset[int]]:
    """Distinct worker pid sets, in order, from the agent's node heartbeats."""
    seen: list[frozenset[int]] = []
    for hb in tap.of(NodeHeartbeat):
        if hb.host == host and hb.pids:
            pids = frozenset(hb.pids.values())
            if not seen or seen[-1] != pids:
                seen.append(pids)
    return seen


async def test_launch_runs_the_job_and_reports_every_exit(
        nats_url: str, redis_url: str, prefix: str, job: str, tmp_path: Path,
        procs: list[Any]) -> None:
    log = tmp_path / "launch.log"
    async with tapped(nats_url, prefix, job) as (tap, _):
        procs.append(launch(job, "node-a", env_for(nats_url, redis_url, prefix), log,
                            trainer=["--steps", "15", "--step-time", "0.01"]))
        assert await exit_code(procs[0]) == 0, log.read_text()[-3000:]
        await wait_until(lambda: len(tap.exits) == 2, what="two worker exits")
        await wait_until(lambda: tap.node_hellos, what="node hello")
    assert sorted((e.rank, e.exit_code) for e in tap.exits) == [(0, 0), (1, 0)]
    hello = tap.node_hellos[0]
    assert (hello.host, hello.local_ranks, hello.hosts_store) == ("node-a", [0, 1], True)
    assert "gpu: unavailable" in log.read_text()
    assert {h.host for h in tap.hellos} == {"node-a"}  # Guard() took its host from launch


async def test_a_raising_rank_exits_with_its_exception_text(
        nats_url: str, redis_url: str, prefix: str, job: str, tmp_path: Path,
        procs: list[Any]) -> None:
    log = tmp_path / "launch.log"
    async with tapped(nats_url, prefix, job) as (tap, _):
        procs.append(launch(job, "node-a", env_for(nats_url, redis_url, prefix), log,
                            trainer=["--steps", "200", "--raise-at", "1:3",
                                     "--raise-message", "CUDA error: an illegal memory access"],
                            torchrun_opts=["--max-restarts", "0"]))
        assert await exit_code(procs[0]) == 1
        await wait_until(lambda: len(tap.exits) == 2, what="two worker exits")
    by_rank = {e.rank: e for e in tap.exits}
    assert by_rank[1].exit_code == 1 and by_rank[1].initiated_by is None
    assert "CUDA error: an illegal memory access" in by_rank[1].stderr_tail
    assert by_rank[0].initiated_by == "launcher"


async def test_restart_replaces_the_workers_twice_and_the_job_finishes(
        nats_url: str, redis_url: str, prefix: str, job: str, tmp_path: Path,
        procs: list[Any]) -> None:
    log = tmp_path / "launch.log"
    s = Subjects(prefix)
    async with tapped(nats_url, prefix, job) as (tap, bus):
        procs.append(launch(job, "node-a", env_for(nats_url, redis_url, prefix), log,
                            trainer=["--steps", "120", "--step-time", "0.02"]))
        for n in (1, 2):
            await wait_until(lambda n=n: len(pids_seen(tap, "node-a")) == n and any(
                r.attempt == n - 1 and r.step >= 3 for r in tap.of(StepReport)),
                timeout=90, what=f"attempt {n - 1} training")
            await bus.publish_durable(s.cmd_all(job), Command(
                id=f"restart-{n}", job=job, kind="restart", issuer="cli"))
            await wait_until(lambda n=n: any(a.command_id == f"restart-{n}" for a in tap.acks),
                             timeout=60, what=f"restart {n} acked")
        assert await exit_code(procs[0]) == 0, log.read_text()[-3000:]
    assert [a.outcome for a in tap.acks] == ["done", "done"]
    assert all(a.responder == "host-node-a" for a in tap.acks)
    assert len(pids_seen(tap, "node-a")) == 3
    initiated = {e.initiated_by for e in tap.exits if e.exit_code != 0}
    assert initiated == {"restart-1", "restart-2"}
    assert {r.attempt for r in tap.of(StepReport)} == {0, 1, 2}
    assert max(r.step for r in tap.of(StepReport) if r.attempt == 2) == 119


async def test_freeze_is_a_true_hang_and_kill_is_a_sigkill_exit(
        nats_url: str, redis_url: str, prefix: str, job: str, tmp_path: Path,
        procs: list[Any]) -> None:
    log = tmp_path / "launch.log"
    s = Subjects(prefix)
    async with tapped(nats_url, prefix, job) as (tap, bus):
        procs.append(launch(job, "node-a", env_for(nats_url, redis_url, prefix), log,
                            launch_opts=["--allow-drills"],
                            trainer=["--steps", "300", "--step-time", "0.02"]))
        await wait_until(lambda: any(r.rank == 1 and r.step >= 3 for r in tap.of(StepReport)),
                         timeout=90, what="training")
        await bus.publish_durable(s.cmd_host(job, "node-a"), Command(
            id="freeze", job=job, kind="freeze", issuer="cli", params={"rank": 1}))
        await wait_until(lambda: any(hb.ranks.get(1) == "T" for hb in tap.of(NodeHeartbeat)),
                         timeout=30, what="rank 1 stopped (T)")
        frozen_at = len(tap.of(NodeHeartbeat))
        last_beat = max(h.seq for h in tap.of(Heartbeat) if h.rank == 1)
        await wait_until(lambda: len(tap.of(NodeHeartbeat)) >= frozen_at + 3,
                         timeout=30, what="three more node heartbeats")
        # A frozen process beats no more: its heartbeat thread is stopped too.
        assert max(h.seq for h in tap.of(Heartbeat) if h.rank == 1 and h.attempt == 0) \
            <= last_beat + 1
        await bus.publish_durable(s.cmd_host(job, "node-a"), Command(
            id="kill", job=job, kind="kill", issuer="cli", params={"rank": 1}))
        await wait_until(lambda: any(e.rank == 1 and e.signal == "SIGKILL" for e in tap.exits),
                         timeout=60, what="SIGKILL exit of rank 1")
        await bus.publish_durable(s.cmd_host(job, "node-a"), Command(
            id="stop", job=job, kind="stop", issuer="cli"))
        # Stopped is not finished: a scheduler must not read it as a success.
        assert await exit_code(procs[0]) == EXIT_STOPPED, log.read_text()[-3000:]
    killed = next(e for e in tap.exits if e.rank == 1 and e.signal == "SIGKILL")
    assert killed.initiated_by is None and killed.exit_code == -9
    assert {a.command_id: a.outcome for a in tap.acks} == {"freeze": "done", "kill": "done",
                                                           "stop": "done"}


async def test_scripted_xid_and_inject_cli(nats_url: str, redis_url: str, prefix: str,
                                           job: str, tmp_path: Path, procs: list[Any]) -> None:
    log = tmp_path / "launch.log"
    env = env_for(nats_url, redis_url, prefix)
    async with tapped(nats_url, prefix, job) as (tap, _):
        procs.append(launch(job, "node-b", env, log, launch_opts=["--allow-drills"],
                            trainer=["--steps", "400", "--step-time", "0.02"]))
        await wait_until(lambda: tap.of(StepReport) and tap.node_hellos, timeout=90,
                         what="training")
        out = await asyncio.to_thread(subprocess.run, [
            sys.executable, "-m", "trainguard", "inject", "--job", job, "--host", "node-b", "xid",
            "79"], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "xid -> host-node-b: done: scripted XID 79 on GPU 0" in out.stdout
        await wait_until(lambda: any(x.code == 79 for g in tap.of(GpuSample) for x in g.xids),
                         timeout=30, what="a GPU sample carrying XID 79")
        out = await asyncio.to_thread(subprocess.run, [
            sys.executable, "-m", "trainguard", "inject", "--job", job, "--rank", "0", "slow", "2"],
            env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "compute phase slowed 2.0x" in out.stdout, out
        procs[0].terminate()  # preemption: SIGTERM asks for a save, then stops
        assert await exit_code(procs[0]) == 143
    sample = next(g for g in tap.of(GpuSample) if g.xids)
    assert sample.host == "node-b" and sample.source.startswith("scripted")


async def test_isolating_one_of_two_hosts_shrinks_the_job(
        nats_url: str, redis_url: str, prefix: str, job: str, tmp_path: Path,
        procs: list[Any]) -> None:
    s = Subjects(prefix)
    env = env_for(nats_url, redis_url, prefix)
    rdzv = ["--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{free_port()}", "--rdzv-id", job]
    trainer = ["--steps", "100000", "--step-time", "0.02"]
    async with tapped(nats_url, prefix, job) as (tap, bus):
        procs.append(launch(job, "node-a", env, tmp_path / "a.log", torchrun_opts=rdzv,
                            trainer=trainer))
        await wait_until(lambda: any(h.host == "node-a" for h in tap.node_hellos), timeout=60,
                         what="node-a up")
        procs.append(launch(job, "node-b", env, tmp_path / "b.log", torchrun_opts=rdzv,
                            trainer=trainer))
        await wait_until(lambda: {r.rank for r in tap.of(StepReport) if r.step >= 2} ==
                         {0, 1, 2, 3}, timeout=120, what="four ranks training")
        await bus.publish_durable(s.cmd_host(job, "node-a"), Command(
            id="iso-a", job=job, kind="isolate", issuer="cli"))
        await bus.publish_durable(s.cmd_host(job, "node-b"), Command(
            id="iso-b", job=job, kind="isolate", issuer="cli"))
        assert await exit_code(procs[1], 90) == EXIT_ISOLATED
        await wait_until(lambda: any(h.world_size == 2 and h.attempt.restart_count > 0
                                     for h in tap.of(RankHello)),
                         timeout=120, what="the job re-formed at world size 2")
        seen = len(tap.of(StepReport))
        await wait_until(lambda: len(tap.of(StepReport)) > seen + 10, timeout=60,
                         what="training goes on at world size 2")
        # The remediator's blocklist keeps the host out: a relaunch refuses to join.
        r = aioredis.Redis.from_url(redis_url)
        await r.hset(Keys(prefix).blocklist(), "node-b", '{"reason": "isolated by test"}')
        await r.aclose()
        procs.append(launch(job, "node-b", env, tmp_path / "b2.log", torchrun_opts=rdzv,
                            trainer=trainer))
        assert await exit_code(procs[2], 60) == EXIT_ISOLATED
        assert "blocklist" in (tmp_path / "b2.log").read_text()
    acks = {a.command_id: a for a in tap.acks}
    assert acks["iso-a"].outcome == "refused" and "rendezvous store" in acks["iso-a"].detail
    assert acks["iso-b"].outcome == "done"
    assert procs[0].poll() is None  # node-a still training


async def test_forged_commands_fence_nothing_and_stop_nothing(
        nats_url: str, redis_url: str, prefix: str, job: str, tmp_path: Path,
        procs: list[Any]) -> None:
    """What one message from anyone on the bus must not do: raise the agent's fencing mark
    above the leader's (every real command refused afterwards), or stop the job. The
    leader's epoch is read from the fence bucket, so a Redis copy raised by anyone with a
    service's Redis user changes nothing."""
    log = tmp_path / "launch.log"
    s = Subjects(prefix)
    redis = aioredis.Redis.from_url(redis_url)
    nc = await nats.connect(nats_url)
    epochs = Epochs(nc.jetstream(), prefix)
    while await epochs.draw("remediator") < 3:  # the leader's current epoch: 3
        pass
    await nc.close()
    await redis.set(Keys(prefix).epoch("remediator"), 2**53)  # a forged Redis copy
    try:
        async with tapped(nats_url, prefix, job) as (tap, bus):
            procs.append(launch(job, "node-a", env_for(nats_url, redis_url, prefix), log,
                                trainer=["--steps", "100000", "--step-time", "0.02"]))
            await wait_until(lambda: any(r.step >= 3 for r in tap.of(StepReport)),
                             timeout=90, what="training")
            forged = {
                "epoch": Command(id="forged-epoch", job=job, kind="dump", issuer="remediator",
                                 epoch=2**53, target="host.node-a"),
                "issuer": Command(id="forged-stop", job=job, kind="stop", issuer="mallory",
                                  target="host.node-a"),
            }
            for cmd in forged.values():
                await bus.publish_durable(s.cmd_host(job, "node-a"), cmd)
            await wait_until(lambda: {a.command_id for a in tap.acks} >= {"forged-epoch",
                                                                         "forged-stop"},
                             timeout=60, what="the forged commands answered")
            real = Command(id="real", job=job, kind="dump", issuer="remediator", epoch=3,
                           target="host.node-a")
            await bus.publish_durable(s.cmd_host(job, "node-a"), real)
            await wait_until(lambda: any(a.command_id == "real" for a in tap.acks),
                             timeout=60, what="the leader's command answered")
            assert procs[0].poll() is None, log.read_text()[-3000:]  # the job runs on
    finally:
        await redis.aclose()
    acks = {a.command_id: a for a in tap.acks}
    assert acks["forged-epoch"].outcome == "refused" and "above" in acks["forged-epoch"].detail
    assert acks["forged-stop"].outcome == "refused" and "issuer" in acks["forged-stop"].detail
    assert acks["real"].outcome == "done", acks["real"].detail
