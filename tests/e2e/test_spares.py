"""Warm spares and per-rank supervision with real gloo jobs under ``trainguard launch``.

What the agent publishes is the evidence: its node heartbeats list the ranks' pids, the
ready spares' pids and the job's generation, and a rank's hello carries its pid and the
generation it joined. A replacement that came from a spare has the spare's pid.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Any

from tests.conftest import wait_until
from tests.e2e.conftest import launch
from tests.e2e.test_agent import env_for, exit_code
from tests.tap import Tap, tapped
from trainguard.agent.exitcodes import EXIT_STOPPED
from trainguard.contract.schemas import Command, Heartbeat, NodeHeartbeat, RankHello, StepReport
from trainguard.contract.subjects import Subjects


def beats(tap: Tap) -> list[NodeHeartbeat]:
    return tap.of(NodeHeartbeat)


async def warm(tap: Tap, ranks: int, stepping: Any) -> NodeHeartbeat:
    """The first node heartbeat with every rank up and a ready spare, once ``stepping``."""
    await wait_until(lambda: stepping() and any(
        len(b.pids) == ranks and b.spares for b in beats(tap)[-3:]),
        timeout=120, what="ranks training and a warm spare ready")
    return next(b for b in reversed(beats(tap)) if len(b.pids) == ranks and b.spares)


def replaced(tap: Tap, rank: int, old_pid: int) -> NodeHeartbeat | None:
    return next((b for b in beats(tap) if b.pids.get(rank, old_pid) != old_pid
                 and len(b.pids) >= rank + 1), None)


def hello_of(tap: Tap, rank: int, pid: int) -> RankHello | None:
    return next((h for h in tap.hellos if h.rank == rank and h.pid == pid), None)


def new_spare(tap: Tap, known: set[int]) -> bool:
    return any(set(b.spares) - known for b in beats(tap))


async def training_with_a_spare(tap: Tap, procs: list[Any], job: str, log: Path,
                                env: dict[str, str]) -> NodeHeartbeat:
    """A 2-rank toy job (drills on) training, with a spare ready: the beat that says so."""
    procs.append(launch(job, "node-a", env, log, launch_opts=["--allow-drills"],
                        trainer=["--steps", "100000", "--step-time", "0.05"]))
    return await warm(tap, 2, lambda: any(r.rank == 1 and r.step >= 3
                                          for r in tap.of(StepReport)))


async def recovered_through_the_spare(tap: Tap, before: NodeHeartbeat) -> NodeHeartbeat:
    """Rank 1's replacement is the spare ``before`` listed; it trains; a new spare comes."""
    spare = before.spares[0]
    await wait_until(lambda: replaced(tap, 1, before.pids[1]) is not None, timeout=90,
                     what="rank 1 replaced")
    after = replaced(tap, 1, before.pids[1])
    assert after is not None and after.pids[1] in before.spares, (before, after)
    await wait_until(lambda: hello_of(tap, 1, after.pids[1]) is not None, timeout=60,
                     what="the replacement's hello")
    hello = hello_of(tap, 1, after.pids[1])
    assert hello is not None and hello.attempt.generation == after.generation
    assert after.generation > before.generation
    await wait_until(lambda: any(r.rank == 1 and r.attempt == hello.attempt.restart_count
                                 and r.step >= 3 for r in tap.of(StepReport)),
                     timeout=90, what="the replacement training")
    known = {*before.spares, *before.pids.values(), *after.pids.values()}
    await wait_until(lambda: new_spare(tap, known), timeout=120, what="a new warm spare")
    assert spare not in {p for b in beats(tap)[-1:] for p in b.spares}  # used: out of the pool
    return after


async def test_a_crash_is_recovered_through_a_warm_spare(
        nats_url: str, redis_url: str, prefix: str, job: str, tmp_path: Path,
        procs: list[Any]) -> None:
    log = tmp_path / "launch.log"
    s = Subjects(prefix)
    async with tapped(nats_url, prefix, job) as (tap, bus):
        before = await training_with_a_spare(tap, procs, job, log,
                                             env_for(nats_url, redis_url, prefix))
        await bus.publish_durable(s.cmd_host(job, "node-a"), Command(
            id="crash", job=job, kind="kill", issuer="cli", params={"rank": 1}))
        after = await recovered_through_the_spare(tap, before)
        await bus.publish_durable(s.cmd_host(job, "node-a"), Command(
            id="stop", job=job, kind="stop", issuer="cli"))
        assert await exit_code(procs[0]) == EXIT_STOPPED, log.read_text()[-3000:]
        await wait_until(lambda: any(e.initiated_by == "stop" and e.rank == 1
                                     for e in tap.exits), what="the stop's exits")
    crash = next(e for e in tap.exits if e.rank == 1 and e.signal == "SIGKILL")
    assert crash.initiated_by is None and crash.pid == before.pids[1]
    peer = next(e for e in tap.exits if e.rank == 0 and e.pid == before.pids[0])
    assert peer.initiated_by == "launcher"
    # The exit of the rank that ran in the spare names the spare's pid.
    stopped = next(e for e in tap.exits if e.rank == 1 and e.initiated_by == "stop")
    assert stopped.pid == after.pids[1]


async def test_a_sigstop_is_recovered_through_a_warm_spare(
        nats_url: str, redis_url: str, prefix: str, job: str, tmp_path: Path,
        procs: list[Any]) -> None:
    """A stopped rank (the hang the detector reports from the T state) and the restart the
    remediator then sends: the stuck rank is killed at once and its spare takes over."""
    log = tmp_path / "launch.log"
    s = Subjects(prefix)
    async with tapped(nats_url, prefix, job) as (tap, bus):
        before = await training_with_a_spare(tap, procs, job, log,
                                             env_for(nats_url, redis_url, prefix))
        await bus.publish_durable(s.cmd_host(job, "node-a"), Command(
            id="freeze", job=job, kind="freeze", issuer="cli", params={"rank": 1}))
        await wait_until(lambda: any(b.ranks.get(1) == "T" for b in beats(tap)), timeout=30,
                         what="rank 1 stopped (T)")
        await bus.publish_durable(s.cmd_all(job), Command(
            id="restart", job=job, kind="restart", issuer="cli"))
        await recovered_through_the_spare(tap, before)
        await bus.publish_durable(s.cmd_host(job, "node-a"), Command(
            id="stop", job=job, kind="stop", issuer="cli"))
        assert await exit_code(procs[0]) == EXIT_STOPPED, log.read_text()[-3000:]
    stuck = next(e for e in tap.exits if e.pid == before.pids[1])
    assert stuck.signal == "SIGKILL" and stuck.initiated_by == "restart"


async def test_the_launcher_restarts_one_rank_alone(
        nats_url: str, redis_url: str, prefix: str, job: str, tmp_path: Path,
        procs: list[Any]) -> None:
    """``restart`` with a rank: that rank is replaced (from the spare) at a new
    generation, while the other rank's process trains on untouched."""
    log = tmp_path / "launch.log"
    s = Subjects(prefix)
    async with tapped(nats_url, prefix, job) as (tap, bus):
        procs.append(launch(job, "node-a", env_for(nats_url, redis_url, prefix), log,
                            module="tests.e2e.solo_trainer",
                            trainer=["--steps", "100000", "--step-time", "0.05"]))
        before = await warm(tap, 2, lambda: {h.rank for h in tap.of(Heartbeat)
                                            if (h.step or 0) >= 3} == {0, 1})
        await bus.publish_durable(s.cmd_host(job, "node-a"), Command(
            id="one", job=job, kind="restart", issuer="cli", params={"rank": 1}))
        await wait_until(lambda: any(a.command_id == "one" for a in tap.acks), timeout=60,
                         what="the restart acked")
        ack = next(a for a in tap.acks if a.command_id == "one")
        assert ack.outcome == "done" and "warm spare" in ack.detail, ack.detail
        await wait_until(lambda: replaced(tap, 1, before.pids[1]) is not None, timeout=30,
                         what="a node heartbeat with the new pid")
        after = replaced(tap, 1, before.pids[1])
        assert after is not None
        assert after.pids[0] == before.pids[0] and after.pids[1] in before.spares
        assert after.generation == before.generation + 1
        await wait_until(lambda: hello_of(tap, 1, after.pids[1]) is not None, timeout=60,
                         what="the replacement's hello")
        hello = hello_of(tap, 1, after.pids[1])
        assert hello is not None and hello.attempt.generation == after.generation
        survivor = max(h.seq for h in tap.of(Heartbeat) if h.pid == before.pids[0])
        await wait_until(lambda: max(h.seq for h in tap.of(Heartbeat)
                                     if h.pid == before.pids[0]) > survivor + 3,
                         timeout=60, what="rank 0 beating on, same process")
        await bus.publish_durable(s.cmd_host(job, "node-a"), Command(
            id="stop", job=job, kind="stop", issuer="cli"))
        assert await exit_code(procs[0]) == EXIT_STOPPED, log.read_text()[-3000:]
    assert [h.pid for h in tap.hellos if h.rank == 0] == [before.pids[0]]
    gone = [e for e in tap.exits if e.initiated_by == "one"]
    assert [(e.rank, e.pid) for e in gone] == [(1, before.pids[1])]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


async def test_spares_die_with_the_agent(
        nats_url: str, redis_url: str, prefix: str, job: str, tmp_path: Path,
        procs: list[Any]) -> None:
    """An agent killed outright (no cleanup of its own) leaves no spare behind."""
    log = tmp_path / "launch.log"
    async with tapped(nats_url, prefix, job) as (tap, _):
        procs.append(launch(job, "node-a", env_for(nats_url, redis_url, prefix), log,
                            nproc=1, module="tests.e2e.solo_trainer",
                            launch_opts=["--warm-spares", "2"],
                            trainer=["--steps", "100000", "--step-time", "0.05"]))
        await wait_until(lambda: any(len(b.spares) == 2 for b in beats(tap)), timeout=120,
                         what="two warm spares ready")
        beat = next(b for b in beats(tap) if len(b.spares) == 2)
        procs[0].kill()
        procs[0].wait(30)
        try:
            await wait_until(lambda: all(_gone(p) for p in beat.spares), timeout=30,
                             what="the spares gone with their agent")
        finally:
            for pid in beat.pids.values():  # a cold rank outlives a killed agent, as under
                with contextlib.suppress(ProcessLookupError):  # torchrun: end it here
                    os.kill(pid, signal.SIGKILL)
