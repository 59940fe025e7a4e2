"""The client inside real multi-process gloo jobs under torchrun."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path
from typing import Any

from tests.conftest import wait_until
from tests.e2e.conftest import job_env, torchrun
from tests.tap import tapped
from trainguard.contract.schemas import Command, Fingerprint, Heartbeat, StepReport
from trainguard.contract.subjects import Subjects


async def finish(proc: subprocess.Popen[bytes], log: Path, timeout: float = 150) -> None:
    code = await asyncio.to_thread(proc.wait, timeout)
    assert code == 0, log.read_text()[-4000:]


async def test_four_rank_job_reports_from_every_rank(nats_url: str, prefix: str, job: str,
                                                     tmp_path: Path, procs: list[Any]) -> None:
    log = tmp_path / "job.log"
    async with tapped(nats_url, prefix, job) as (tap, _):
        procs.append(torchrun(4, ["--job", job, "--steps", "30", "--step-time", "0.01"],
                              job_env(nats_url, prefix), log))
        await finish(procs[0], log)
        await wait_until(lambda: len(tap.of(StepReport)) == 120, timeout=30,
                         what="30 reports from each of 4 ranks")
    by_rank: dict[int, list[int]] = {}
    for r in tap.of(StepReport):
        by_rank.setdefault(r.rank, []).append(r.step)
    assert {k: sorted(v) for k, v in by_rank.items()} == {k: list(range(30)) for k in range(4)}
    assert {h.rank for h in tap.of(Heartbeat)} == {0, 1, 2, 3}
    assert {hello.rank for hello in tap.hellos} == {0, 1, 2, 3}
    assert all(hello.world_size == 4 for hello in tap.hellos)
    # Data-parallel replicas stay bit-identical: their fingerprints agree step by step.
    fps: dict[int, set[int]] = {}
    for f in tap.of(Fingerprint):
        fps.setdefault(f.step, set()).add(f.checksum)
    assert sorted(fps) == [0, 10, 20] and all(len(v) == 1 for v in fps.values())
    losses = [r.loss for r in tap.of(StepReport)]
    assert all(loss is not None and loss > 0 for loss in losses)


async def test_ddp_hook_times_the_collective_wait(nats_url: str, prefix: str, job: str,
                                                  tmp_path: Path, procs: list[Any]) -> None:
    log = tmp_path / "job.log"
    async with tapped(nats_url, prefix, job) as (tap, _):
        procs.append(torchrun(2, ["--job", job, "--steps", "20", "--ddp", "--step-time",
                                  "0.01"], job_env(nats_url, prefix), log))
        await finish(procs[0], log)
        await wait_until(lambda: len(tap.of(StepReport)) == 40, timeout=30, what="reports")
    reports = tap.of(StepReport)
    assert all("comm" in r.phases and r.phases["comm"] > 0 for r in reports)
    assert all(r.phases["compute"] >= 0 for r in reports)
    seqs = [h.coll_seq for h in tap.of(Heartbeat) if h.rank == 0]
    assert seqs == sorted(seqs) and seqs[-1] > 0
    assert all(h.coll_done <= h.coll_seq for h in tap.of(Heartbeat))


async def test_collective_command_runs_at_the_same_step_on_every_rank(
        nats_url: str, prefix: str, job: str, tmp_path: Path, procs: list[Any]) -> None:
    """Three set_interval commands, one after the other, each at one step on both ranks.
    ``--sync-every 1000`` is only the cap: the ranks agree about every ``sync_period``
    (0.25 s, about 5 of these steps), so the commands run long before step 1000."""
    log = tmp_path / "job.log"
    s = Subjects(prefix)
    async with tapped(nats_url, prefix, job) as (tap, bus):
        procs.append(torchrun(2, ["--job", job, "--steps", "100000", "--step-time", "0.05",
                                  "--sync-every", "1000"], job_env(nats_url, prefix), log))
        await wait_until(lambda: {r.rank for r in tap.of(StepReport)} == {0, 1}, timeout=60,
                         what="both ranks training")
        for seq in (1, 2, 3):
            await bus.publish_durable(s.cmd_all(job), Command(
                id=f"interval-{seq}", job=job, kind="set_interval", issuer="coordinator",
                seq=seq, params={"every_steps": 20 + seq}))
            await wait_until(lambda seq=seq: len(tap.acks) == 2 * seq, timeout=60,
                             what=f"two acks of command {seq}")
        steps = max(r.step for r in tap.of(StepReport))  # the fixture stops the job
    assert steps < 1000  # no agreement at the cap's boundary yet: the period's ran them
    for seq in (1, 2, 3):
        acks = [a for a in tap.acks if a.command_id == f"interval-{seq}"]
        assert {a.responder for a in acks} == {"rank-0", "rank-1"}
        assert all(a.outcome == "done" for a in acks)
        details = {a.detail for a in acks}
        assert len(details) == 1, details  # the same from_step on both ranks
