"""In-place recovery with real gloo ranks (the toy trainer, ``--in-place``) on loopback.

The test plays the agent (tests/inplace_job.py): it holds the job store, kills a rank with
SIGKILL, raises the generation and starts the replacement with ``TRAINGUARD_JOIN=peers``.
Training is deterministic (batches keyed by seed, rank and step), so a run that recovered
in place must end with parameters bit-identical to a run that was never interrupted. The
ranks' Guards talk to a real nats-server where the test reads their RecoveryReports.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import wait_until
from tests.inplace_job import Job, same_params
from tests.tap import Tap, tapped
from trainguard.contract import envnames
from trainguard.contract.codec import decode_any_durable
from trainguard.contract.envelope import normalize_headers
from trainguard.contract.rpc import MEMORY_ONLY
from trainguard.contract.schemas import Command, CommandAck, RankHello, RecoveryReport
from trainguard.contract.subjects import Subjects
from trainguard.contract.targets import addressed
from trainguard.core.connection import flush
from trainguard.recovery import groupstore
from trainguard.runtime.bus import Bus
from trainguard.runtime.topology import streams

WORLD = 3
STEPS = 40
ARGS = ["--in-place", "--steps", str(STEPS), "--step-time", "0.03", "--pg-timeout", "60",
        "--rejoin-timeout", "60"]
DDP = ["--ddp"]


def uninterrupted(tmp: Path, args: list[str]) -> dict[str, Any]:
    tmp.mkdir(exist_ok=True)
    job = Job(tmp, WORLD, args).start()
    try:
        assert job.wait() == dict.fromkeys(range(WORLD), 0), job.logs()
        assert job.steps_done() == list(range(STEPS))
        return job.final_params()
    finally:
        job.stop()


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return uninterrupted(tmp_path_factory.mktemp("baseline"), ARGS)


@pytest.fixture(scope="module")
def baseline_ddp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return uninterrupted(tmp_path_factory.mktemp("baseline-ddp"), [*ARGS, *DDP])


@contextlib.asynccontextmanager
async def recoveries(url: str, prefix: str, job: str
                     ) -> AsyncIterator[tuple[dict[str, RecoveryReport], Tap, Bus]]:
    """The topology, a tap on the job, and its RecoveryReports by id (JetStream retries are
    one report)."""
    got: dict[str, RecoveryReport] = {}
    async with tapped(url, prefix, job) as (tap, bus):
        subjects = Subjects(prefix)
        pattern = subjects.pattern("recovery")
        if not any(pattern in spec.subjects for spec in streams(prefix)):
            # Until the topology captures recovery reports, a stream of the test's own acks
            # them (else the rank's durable queue would stall behind them).
            await bus.nc.jetstream().add_stream(name=f"{prefix}_RECOVERY", subjects=[pattern])

        async def on_msg(msg: Any) -> None:
            report = decode_any_durable(msg.data, normalize_headers(msg.headers).get("ce-type"))
            if isinstance(report, RecoveryReport):
                got.setdefault(report.id, report)

        await bus.nc.subscribe(subjects.pattern("recovery", job=job), cb=on_msg)
        await flush(bus.nc)
        yield got, tap, bus


def bus_env(url: str, prefix: str, job: str) -> dict[str, str]:
    return {envnames.NATS_URL: url, envnames.SUBJECT_PREFIX: prefix, envnames.JOB: job,
            envnames.DISABLED: "0"}


def wait_ready(job: Job) -> None:
    """What the agent checks before it replaces a rank alone."""
    deadline = time.monotonic() + 60
    while not job.ready_in_place():
        assert time.monotonic() < deadline, "the ranks never set their in-place keys"
        time.sleep(0.02)


def kill_and_replace(job: Job, victim: int) -> dict[int, int]:
    """Returns the survivors' pids, checked unchanged once the job finished."""
    try:
        job.start()
        job.wait_for_step(12)
        wait_ready(job)
        survivors = {r: p.pid for r, p in job.procs.items() if r != victim}
        job.kill(victim)
        job.replace(victim)
        assert job.wait() == dict.fromkeys(range(WORLD), 0), job.logs()
        assert {r: job.procs[r].pid for r in survivors} == survivors
        return survivors
    finally:
        job.stop()


def check_replaced(job: Job, reports: dict[str, RecoveryReport], victim: int) -> None:
    # Rank 0 never restarted and never ran a completed step twice.
    assert job.steps_done() == list(range(STEPS)), job.logs()
    assert len(set(job.pids())) == 1
    assert job.ready_in_place(), "the re-formed generation's ranks set their keys again"
    [report] = [r for r in reports.values() if r.path == "in_place"]
    assert (report.kind, report.rank, report.generation, report.previous_generation) == \
        ("replace", 0, job.generation, job.generation - 1)
    assert report.joined == [victim] and report.world_size == WORLD
    assert report.steps_lost == 0 and report.resumed_step == report.last_completed + 1
    assert report.source_rank is not None and report.source_rank != victim
    assert report.failed_step == report.resumed_step and report.seconds > 0


async def test_a_killed_rank_is_replaced_in_place_and_nothing_is_lost(
        baseline: dict[str, Any], tmp_path: Path, nats_url: str, prefix: str,
        job: str) -> None:
    async with recoveries(nats_url, prefix, job) as (reports, _, _):
        run = Job(tmp_path, WORLD, ARGS, env=bus_env(nats_url, prefix, job))
        await asyncio.to_thread(kill_and_replace, run, 2)
        await wait_until(lambda: reports, what="the recovery report")
    check_replaced(run, reports, victim=2)
    assert same_params(run.final_params(), baseline) == []


async def test_four_ranks_see_a_loss_at_once_and_the_replacement_saves_in_step(
        tmp_path: Path, nats_url: str, prefix: str, job: str) -> None:
    """With four gloo ranks, survivors not next to the lost rank in the ring learn of the
    loss from their neighbours' teardown, not from their collective timeout (set far
    beyond the test's). And the replacement takes its peers' checkpoint interval, which a
    ``set_interval`` changed before it came: on its own default it would save at other
    steps, and the save's collective would meet its peers' all_reduce."""
    world, ckpt = 4, tmp_path / "ckpt"
    args = [*ARGS, "--pg-timeout", "900", "--ckpt-root", str(ckpt), "--ckpt-every", "10",
            "--sync-every", "5"]
    async with recoveries(nats_url, prefix, job) as (reports, tap, bus):
        run = Job(tmp_path, world, args, env=bus_env(nats_url, prefix, job))
        await asyncio.to_thread(run.start)
        try:
            await asyncio.to_thread(run.wait_for_step, 8)
            await wait_until(lambda: len(tap.hellos) == world, what="the ranks' hellos")
            await bus.publish_durable(Subjects(prefix).cmd_all(job), Command(
                id="interval-1", job=job, kind="set_interval", issuer="cli", at_step=15,
                params={"every_steps": 4, "from_step": 16}))
            await wait_until(lambda: [a.outcome for a in tap.acks
                                      if a.command_id == "interval-1"] == ["done"] * world,
                             what="the set_interval acks")
            await asyncio.to_thread(wait_ready, run)
            run.kill(2)
            run.replace(2)
            codes = await asyncio.to_thread(run.wait, 300.0)
        finally:
            run.stop()
        await wait_until(lambda: any(r.path == "in_place" for r in reports.values()),
                         what="the recovery report")
    assert codes == dict.fromkeys(range(world), 0), run.logs()
    assert run.steps_done() == list(range(STEPS))
    [report] = [r for r in reports.values() if r.path == "in_place"]
    assert report.joined == [2] and report.steps_lost == 0
    assert report.seconds < 300, report  # a survivor waiting out its timeout takes 900 s
    saved = sorted(int(d.name.removeprefix("step-")) for d in (ckpt / job).glob("step-*"))
    assert saved == [9, *range(19, STEPS, 4)], saved


async def test_ddp_is_rebuilt_on_the_new_group_and_nothing_is_lost(
        baseline_ddp: dict[str, Any], tmp_path: Path, nats_url: str, prefix: str,
        job: str) -> None:
    async with recoveries(nats_url, prefix, job) as (reports, _, _):
        run = Job(tmp_path, WORLD, [*ARGS, *DDP], env=bus_env(nats_url, prefix, job))
        # Rank 0 is the one replaced: DDP's construction broadcasts rank 0's parameters,
        # so a rebuild before the state agreement would spread the replacement's.
        await asyncio.to_thread(kill_and_replace, run, 0)
        await wait_until(lambda: reports, what="the recovery report")
    assert [r.joined for r in reports.values() if r.path == "in_place"] == [[0]]
    # Not bit for bit: a DDP built anew sums its first gradients in another order than a
    # long-running one (rebuilding it at a step without any failure changes the last bits
    # too). A step lost or run twice moves the parameters by ~1e-3; rounding by ~1e-8.
    final = run.final_params()
    assert {k: (final[k] - v).abs().max().item() for k, v in baseline_ddp.items()
            if not torch.allclose(final[k], v, rtol=0, atol=1e-6)} == {}
    assert run.steps_done() == list(range(STEPS)) and len(set(run.pids())) == 2


async def reloaded_at_25(tmp_path: Path, nats_url: str, prefix: str, job: str,
                         args: list[str], params: dict[str, Any]
                         ) -> tuple[Job, RecoveryReport, list[CommandAck]]:
    """Run the job, send a ``reload`` with ``params`` for step 25, and return the run once
    it ended (every rank 0, no process restarted, steps 20..25 run twice), the one
    recovery report and the reload's acks."""
    async with recoveries(nats_url, prefix, job) as (reports, tap, bus):
        run = Job(tmp_path, WORLD, args, env=bus_env(nats_url, prefix, job))
        await asyncio.to_thread(run.start)
        pids = {r: p.pid for r, p in run.procs.items()}
        try:
            await asyncio.to_thread(run.wait_for_step, 12)
            await wait_until(lambda: len(tap.hellos) == WORLD, what="the ranks' hellos")
            await bus.publish_durable(Subjects(prefix).cmd_all(job), Command(
                id="reload-1", job=job, kind="reload", issuer="cli", at_step=25,
                params=params))
            codes = await asyncio.to_thread(run.wait)
        finally:
            run.stop()
        await wait_until(lambda: acked(tap) == ["done"] * WORLD, what="the reload acks")
        await wait_until(lambda: reports, what="the recovery report")
    assert codes == dict.fromkeys(range(WORLD), 0), run.logs()
    assert {r: p.pid for r, p in run.procs.items()} == pids  # no process restarted
    assert run.steps_done() == [*range(26), *range(20, STEPS)]
    [report] = reports.values()
    return run, report, [a for a in tap.acks if a.command_id == "reload-1"]


async def test_a_rollback_reloads_the_checkpoint_in_every_process(
        baseline: dict[str, Any], tmp_path: Path, nats_url: str, prefix: str,
        job: str) -> None:
    ckpt = tmp_path / "ckpt"
    args = [*ARGS, "--ckpt-root", str(ckpt), "--ckpt-every", "10", "--sync-every", "5"]
    run, report, _ = await reloaded_at_25(tmp_path, nats_url, prefix, job, args, {
        "step": 19, "path": str(ckpt / job / "step-19")})
    assert (report.kind, report.path, report.tier, report.steps_lost) == (
        "rollback", "in_place", "disk", 6)
    assert (report.last_completed, report.resumed_step) == (25, 20)
    # Training is deterministic: replaying 20..25 from the checkpoint ends where a run that
    # never rolled back ends.
    assert same_params(run.final_params(), baseline) == []


@pytest.mark.parametrize("layout", [[], ["--parallel", "fsdp", "--optimizer", "adamw"]],
                         ids=["replicated", "fsdp"])
async def test_a_rollback_below_a_nan_restores_the_memory_snapshot_before_it(
        baseline: dict[str, Any], tmp_path: Path, nats_url: str, prefix: str,
        job: str, layout: list[str]) -> None:
    """Rank 1's parameters turn NaN at step 20 (the gradients' reduction spreads it); a
    rollback below step 20 takes every rank's memory snapshot of step 19 (its shard, with
    FSDP2), not the disk's step 9: six steps run again instead of sixteen, and the run
    ends as one that never failed."""
    ckpt = tmp_path / "ckpt"
    # A snapshot every step: "auto" spaces them by their measured cost, which a loaded
    # machine inflates (the newest below the onset was then step 9's, not 19's).
    args = [*ARGS, *layout, "--ckpt-root", str(ckpt), "--ckpt-every", "10",
            "--sync-every", "5", "--nan-at", "1:20", "--memory-snapshots", "1"]
    if layout:
        baseline = uninterrupted(tmp_path / "baseline", [*ARGS, *layout])
    run, report, acks = await reloaded_at_25(tmp_path, nats_url, prefix, job, args, {
        "step": 9, "path": str(ckpt / job / "step-9"), "below": 20})
    assert (report.kind, report.path, report.tier, report.steps_lost) == (
        "rollback", "in_place", "memory", 6), report
    assert "the snapshot of step 19" in report.reason
    assert all("from memory" in a.detail for a in acks)
    assert same_params(run.final_params(), baseline) == []


async def test_a_rollback_with_nothing_on_disk_restores_the_memory_snapshot_alone(
        baseline: dict[str, Any], tmp_path: Path, nats_url: str, prefix: str,
        job: str) -> None:
    """A NaN before the first checkpoint: the coordinator has nothing on disk to point at,
    so the reload names no disk step (``MEMORY_ONLY``) and every rank restores its memory
    snapshot of step 19 alone."""
    ckpt = tmp_path / "ckpt"
    args = [*ARGS, "--ckpt-root", str(ckpt), "--ckpt-every", "1000", "--sync-every", "5",
            "--nan-at", "1:20", "--memory-snapshots", "1"]
    run, report, acks = await reloaded_at_25(tmp_path, nats_url, prefix, job, args, {
        "step": MEMORY_ONLY, "path": "", "below": 20})
    assert (report.kind, report.tier, report.resumed_step, report.steps_lost) == (
        "rollback", "memory", 20, 6), report
    assert all("from memory" in a.detail for a in acks)
    assert not list(ckpt.glob(f"{job}/step-*"))  # nothing was ever on disk
    assert same_params(run.final_params(), baseline) == []


def acked(tap: Tap) -> list[str]:
    return [a.outcome for a in tap.acks if a.command_id == "reload-1"]


def lose_a_rank(run: Job, *, leaving: str | None = None,
                bump: bool = False) -> tuple[dict[int, int], float]:
    """Kill rank 2 and replace nobody; ``leaving``: first say, as an agent whose launcher
    ends does, that its host left the job; ``bump``: raise the generation as for a
    replacement that then never starts. The ranks' exit codes, and the seconds from the
    kill to the last exit."""
    try:
        run.start()
        run.wait_for_step(5)
        wait_ready(run)
        if leaving is not None:
            run.job_store.set(groupstore.left_key(run.generation), leaving)
        run.kill(2)
        t0 = time.monotonic()
        del run.procs[2]
        if bump:
            run.generation = int(run.job_store.add(groupstore.GENERATION, 1))
        return run.wait(), time.monotonic() - t0
    finally:
        run.stop()


async def test_no_new_generation_re_raises_the_original_error(
        tmp_path: Path, nats_url: str, prefix: str, job: str) -> None:
    rejoin = 3.0
    args = [*ARGS, "--steps", "400", "--rejoin-timeout", str(rejoin)]
    async with recoveries(nats_url, prefix, job) as (reports, _, _):
        run = Job(tmp_path, WORLD, args, env=bus_env(nats_url, prefix, job))
        codes, elapsed = await asyncio.to_thread(lose_a_rank, run)
        await wait_until(lambda: len(reports) == 2, what="both survivors' reports")
    assert all(code != 0 for code in codes.values()), run.logs()
    assert rejoin <= elapsed < rejoin + 60
    logs = run.logs()
    assert "the generation stayed" in logs and "RejoinFailed" in logs
    assert "gloo" in logs.lower()  # the original error is the one that ends the rank
    restart = [r for r in reports.values() if r.path == "restart"]
    assert sorted(r.rank for r in restart) == [0, 1]
    assert all("no replacement came" in r.reason for r in restart)


async def test_a_host_that_left_ends_the_wait_at_once_and_says_so(
        tmp_path: Path, nats_url: str, prefix: str, job: str) -> None:
    """An isolated host's ranks are not replaced: the survivors do not wait out their
    rejoin timeout (300 s here) but exit for the group restart, with the host's reason."""
    rejoin = 300.0
    args = [*ARGS, "--steps", "400", "--rejoin-timeout", str(rejoin)]
    why = "host node-b left the job (isolated by command c1)"
    async with recoveries(nats_url, prefix, job) as (reports, _, _):
        run = Job(tmp_path, WORLD, args, env=bus_env(nats_url, prefix, job))
        codes, elapsed = await asyncio.to_thread(lose_a_rank, run, leaving=why)
        await wait_until(lambda: len(reports) == 2, what="both survivors' reports")
    assert all(code != 0 for code in codes.values()), run.logs()
    assert elapsed < rejoin, run.logs()
    restart = [r for r in reports.values() if r.path == "restart"]
    assert sorted(r.rank for r in restart) == [0, 1]
    assert all(why in r.reason and "world size that is left" in r.reason for r in restart)


async def test_a_host_that_leaves_in_place_leaves_the_survivors_running_smaller(
        tmp_path: Path, nats_url: str, prefix: str, job: str) -> None:
    """Rank 2's host leaves with a resize record (as an isolated agent does): ranks 0 and 1
    keep their processes, re-form at world size 2, lose no step, say hello at the new
    size and finish; rank 0 reports the resize."""
    why = "host node-b left the job (isolated by command c1)"

    def leave() -> None:
        try:
            run.start()
            run.wait_for_step(8)
            wait_ready(run)
            run.shrink(2, why)
            assert run.wait() == {0: 0, 1: 0}, run.logs()
        finally:
            run.stop()

    async with recoveries(nats_url, prefix, job) as (reports, tap, _):
        run = Job(tmp_path, WORLD, ARGS, env=bus_env(nats_url, prefix, job))
        await asyncio.to_thread(leave)
        await wait_until(lambda: [r for r in reports.values() if r.kind == "resize"],
                         what="the resize report")
        await wait_until(lambda: sorted(h.rank for h in tap.durable if isinstance(
            h, RankHello) and h.world_size == 2) == [0, 1], what="hellos at world size 2")
    assert run.steps_done() == list(range(STEPS)), run.logs()
    assert len(set(run.pids())) == 1  # rank 0 never restarted
    assert run.ready_in_place(), "the smaller generation's ranks set their keys"
    [report] = [r for r in reports.values() if r.kind == "resize"]
    assert (report.path, report.rank, report.world_size, report.generation) == (
        "in_place", 0, 2, run.generation)
    assert report.reason == why and report.joined == []
    assert report.steps_lost == 0 and report.resumed_step == report.last_completed + 1
    assert not [r for r in reports.values() if r.path == "restart"]


async def test_a_middle_host_leaving_renumbers_the_ranks_after_it_in_place(
        tmp_path: Path, nats_url: str, prefix: str, job: str) -> None:
    """Rank 1's host leaves: rank 2 keeps its process as rank 1 of 2, says hello as such,
    takes the commands of rank 1 (a drill addressed to it is acked by it) and the job
    finishes with no step lost."""
    env = {**bus_env(nats_url, prefix, job), envnames.ALLOW_DRILLS: "1"}
    run = Job(tmp_path, WORLD, [*ARGS, "--steps", "300"], env=env)
    async with recoveries(nats_url, prefix, job) as (reports, tap, bus):
        await asyncio.to_thread(run.start)
        moved = run.procs[2].pid
        try:
            await asyncio.to_thread(run.wait_for_step, 8)
            await asyncio.to_thread(wait_ready, run)
            await asyncio.to_thread(run.shrink, 1, "host node-b left the job (isolated)")
            hello = await wait_until(lambda: [h for h in tap.durable if isinstance(
                h, RankHello) and h.world_size == 2 and h.rank == 1], what="the new rank 1")
            assert hello[0].pid == moved
            subject, cmd = addressed(Subjects(prefix), job, "slow", {"factor": 1.0},
                                     issuer="cli", rank=1)
            await bus.publish_durable(subject, cmd)
            acks = await wait_until(lambda: [a for a in tap.acks if a.command_id == cmd.id],
                                    what="the renumbered rank's ack")
            codes = await asyncio.to_thread(run.wait)
        finally:
            run.stop()
        await wait_until(lambda: [r for r in reports.values() if r.kind == "resize"],
                         what="the resize report")
    assert codes == {0: 0, 2: 0}, run.logs()
    assert [(a.responder, a.outcome) for a in acks] == [("rank-1", "done")]
    assert run.steps_done() == list(range(300)), run.logs()
    [report] = [r for r in reports.values() if r.kind == "resize"]
    assert (report.world_size, report.steps_lost, report.joined) == (2, 0, [])


async def test_a_replacement_that_never_comes_ends_the_wait_at_the_rejoin_deadline(
        tmp_path: Path, nats_url: str, prefix: str, job: str) -> None:
    """The generation rises but rank 2's replacement never starts: the survivors do not
    sit in init_process_group for the process group's timeout (60 s here) but give up at
    their rejoin deadline (3 s), saying which generation was short."""
    rejoin = 3.0
    args = [*ARGS, "--steps", "400", "--rejoin-timeout", str(rejoin)]
    async with recoveries(nats_url, prefix, job) as (reports, _, _):
        run = Job(tmp_path, WORLD, args, env=bus_env(nats_url, prefix, job))
        codes, elapsed = await asyncio.to_thread(lose_a_rank, run, bump=True)
        await wait_until(lambda: len(reports) == 2, what="both survivors' reports")
    assert all(code != 0 for code in codes.values()), run.logs()
    assert rejoin <= elapsed < 60, run.logs()
    restart = [r for r in reports.values() if r.path == "restart"]
    assert sorted(r.rank for r in restart) == [0, 1]
    assert all(f"ranks of generation {run.generation} came within" in r.reason
               for r in restart), [r.reason for r in restart]
