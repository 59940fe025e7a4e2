"""The trainer client against a real nats-server: telemetry, commands, outages."""

from __future__ import annotations

import asyncio
import math
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import wait_until
from tests.tap import tapped
from trainguard import Guard
from trainguard.client import DrillCrash
from trainguard.contract.schemas import Command, Heartbeat, StepReport
from trainguard.contract.subjects import Subjects
from trainguard.core.identity import resolve_identity
from trainguard.core.rankstate import QUIET_BEAT_S
from trainguard.runtime.embedded import NatsServer, free_port


def make_guard(url: str, prefix: str, job: str, **kw: Any) -> Guard:
    kw.setdefault("heartbeat_interval", 0.1)
    return Guard(job=job, rank=kw.pop("rank", 0), world_size=kw.pop("world_size", 1),
                 host="node-t", nats_url=url, prefix=prefix, **kw)


def train(guard: Guard, steps: range, step_time: float = 0.005,
          between: Callable[[int], None] | None = None) -> list[float]:
    """A stand-in training loop; returns each step's wall time as the loop saw it."""
    durations = []
    for i in steps:
        t0 = time.perf_counter()
        with guard.step(i) as s:
            with s.phase("data"):
                time.sleep(step_time / 5)
            with s.phase("compute"):
                time.sleep(step_time)
            s.report(loss=1.0 / (i + 1), grad_norm=0.5, tokens=128)
        durations.append(time.perf_counter() - t0)
        if between:
            between(i)
    return durations


async def test_loop_publishes_heartbeats_and_step_reports(nats_url: str, prefix: str,
                                                          job: str) -> None:
    async with tapped(nats_url, prefix, job) as (tap, _):
        guard = make_guard(nats_url, prefix, job, seed=7)
        await asyncio.to_thread(train, guard, range(30))
        await wait_until(lambda: len(tap.of(StepReport)) == 30, what="30 step reports")
        await wait_until(lambda: tap.of(Heartbeat) and tap.hellos, what="heartbeat + hello")
        guard.close()
    reports = sorted(tap.of(StepReport), key=lambda r: r.step)
    assert [r.step for r in reports] == list(range(30))
    r = reports[9]
    assert r.loss == pytest.approx(0.1) and r.grad_norm == 0.5 and r.tokens == 128
    assert set(r.phases) == {"data", "compute"}
    assert r.phases["compute"] >= 0.005 and r.duration >= sum(r.phases.values())
    assert [x.seq for x in reports] == sorted(x.seq for x in reports)
    hb = tap.of(Heartbeat)[-1]
    assert (hb.rank, hb.host, hb.job) == (0, "node-t", job)
    hello = tap.hellos[0]
    assert hello.world_size == 1 and hello.env["seed"] == "7" and "python" in hello.env


async def test_heartbeats_continue_while_the_main_thread_is_blocked(
        nats_url: str, prefix: str, job: str) -> None:
    async with tapped(nats_url, prefix, job) as (tap, _):
        guard = make_guard(nats_url, prefix, job)
        release = threading.Event()

        def blocked_loop() -> None:
            train(guard, range(3))
            with guard.step(3) as s, s.phase("comm"):
                release.wait(30)  # stands in for a collective that never returns

        worker = threading.Thread(target=blocked_loop)
        worker.start()

        def comm_beats() -> list[Heartbeat]:
            return [h for h in tap.of(Heartbeat) if h.step == 3 and h.phase == "comm"]

        beats = await wait_until(lambda: len(comm_beats()) >= 5 and comm_beats(),
                                 what="heartbeats from inside the blocked phase")
        assert beats[-1].phase_elapsed > beats[0].phase_elapsed
        release.set()
        await asyncio.to_thread(worker.join, 10)
        guard.close()


async def test_a_step_that_runs_long_sends_one_heartbeat_at_once(
        nats_url: str, prefix: str, job: str) -> None:
    """The early beat: with beats an hour apart, the only beat from inside the stalled
    step is the one sent because it ran past 4x the usual step."""
    async with tapped(nats_url, prefix, job) as (tap, _):
        guard = make_guard(nats_url, prefix, job, heartbeat_interval=3600.0)
        release = threading.Event()

        def stalling_loop() -> None:
            train(guard, range(20))
            with guard.step(20) as s, s.phase("comm"):
                release.wait(30)

        worker = threading.Thread(target=stalling_loop)
        worker.start()
        try:
            [beat] = await wait_until(
                lambda: [h for h in tap.of(Heartbeat) if h.step == 20],
                what="a heartbeat from inside the stalled step")
            assert beat.phase == "comm" and beat.phase_elapsed >= 0.0
            assert guard.state.usual_step is not None and guard.state.usual_step < 0.25
        finally:
            release.set()
            await asyncio.to_thread(worker.join, 10)
            guard.close()
    assert len([h for h in tap.of(Heartbeat) if h.step == 20 and h.phase == "comm"]) == 1


async def test_commands_run_at_safe_points_in_order_once_and_are_acked(
        nats_url: str, prefix: str, job: str) -> None:
    s = Subjects(prefix)
    async with tapped(nats_url, prefix, job) as (tap, bus):
        guard = make_guard(nats_url, prefix, job, rank=1, world_size=2)
        ran: list[tuple[str, int | None, str | None]] = []
        in_step = threading.Event()

        def note(cmd: Command) -> str:
            ran.append((cmd.id, guard.state.step, guard.state.phase))
            return "noted"

        guard.on("note", note)
        stop = threading.Event()

        def loop() -> None:
            i = 0
            while not stop.is_set():
                with guard.step(i) as st:
                    in_step.set()
                    with st.phase("compute"):
                        time.sleep(0.005)
                i += 1

        worker = threading.Thread(target=loop)
        worker.start()
        await wait_until(lambda: guard.connected and in_step.is_set(),
                         what="guard connected")
        cmds = [Command(id=f"c{i}", job=job, kind="note", issuer="cli") for i in range(3)]
        for c in cmds:
            await bus.publish_durable(s.cmd_rank(job, 1), c)
        await bus.publish_durable(s.cmd_all(job), cmds[0])  # redelivered id: not run again
        await bus.publish_durable(s.cmd_rank(job, 0), Command(
            id="other-rank", job=job, kind="note", issuer="cli", target="rank.0"))
        await bus.publish_durable(s.cmd_all(job), Command(  # misrouted: left to rank 0
            id="for-rank-0", job=job, kind="note", issuer="cli", target="rank.0"))
        await bus.publish_durable(s.cmd_all(job), Command(
            id="bogus", job=job, kind="levitate", issuer="cli"))
        await bus.publish_durable(s.cmd_all(job), Command(
            id="agent-only", job=job, kind="restart", issuer="cli"))
        await wait_until(lambda: {a.command_id for a in tap.acks} >= {"c0", "c1", "c2",
                                                                         "bogus"},
                         what="acks")
        stop.set()
        await asyncio.to_thread(worker.join, 10)
        guard.close()
    assert [r[0] for r in ran] == ["c0", "c1", "c2"]
    assert all(phase == "step" or phase is None for _, _, phase in ran), ran
    by_id = {a.command_id: a for a in tap.acks}
    assert by_id["c1"].outcome == "done" and by_id["c1"].detail == "noted"
    assert by_id["c1"].responder == "rank-1"
    assert by_id["bogus"].outcome == "unknown_kind"
    assert "agent-only" not in by_id and "other-rank" not in by_id
    assert "for-rank-0" not in by_id  # arrived before "bogus", which was answered
    assert sum(1 for a in tap.acks if a.command_id == "c0") == 1


async def test_at_step_runs_exactly_there_and_late_commands_say_too_late(
        nats_url: str, prefix: str, job: str) -> None:
    s = Subjects(prefix)
    async with tapped(nats_url, prefix, job) as (tap, bus):
        guard = make_guard(nats_url, prefix, job)
        completed: list[int] = []
        ran_after: list[int] = []
        guard.on("note", lambda cmd: ran_after.append(guard.state.step) or None)
        gate = threading.Event()

        def loop() -> None:
            for i in range(40):
                if i == 5:
                    gate.wait(30)
                with guard.step(i):
                    pass
                completed.append(i)

        worker = threading.Thread(target=loop)
        worker.start()
        await wait_until(lambda: len(completed) == 5 and guard.connected,
                         what="five steps")
        await bus.publish_durable(s.cmd_all(job), Command(id="at20", job=job, kind="note",
                                                          issuer="cli", at_step=20))
        await bus.publish_durable(s.cmd_all(job), Command(id="at2", job=job, kind="note",
                                                          issuer="cli", at_step=2))
        await wait_until(lambda: len(guard.commands.inbox) == 2, what="commands received")
        gate.set()
        await wait_until(lambda: {a.command_id for a in tap.acks} == {"at20", "at2"},
                         what="acks")
        await asyncio.to_thread(worker.join, 10)
        guard.close()
    by_id = {a.command_id: a.outcome for a in tap.acks}
    assert by_id == {"at20": "done", "at2": "too_late"}
    assert ran_after == [20]


async def test_drills_are_refused_unless_allowed_and_crash_reaches_the_loop(
        nats_url: str, prefix: str, job: str) -> None:
    s = Subjects(prefix)
    async with tapped(nats_url, prefix, job) as (tap, bus):
        guard = make_guard(nats_url, prefix, job, allow_drills=False)
        await asyncio.to_thread(train, guard, range(2))
        await wait_until(lambda: guard.connected, what="connected")
        await bus.publish_durable(s.cmd_all(job), Command(id="n1", job=job, kind="nan",
                                                          issuer="cli"))
        await wait_until(lambda: len(guard.commands.inbox) == 1, what="drill received")
        await asyncio.to_thread(train, guard, range(2, 4))
        await wait_until(lambda: tap.acks, what="ack")
        assert tap.acks[0].outcome == "failed" and "--allow-drills" in tap.acks[0].detail
        guard.allow_drills = True
        await bus.publish_durable(s.cmd_all(job), Command(id="n2", job=job, kind="nan",
                                                          issuer="cli"))
        await wait_until(lambda: len(guard.commands.inbox) == 1, what="nan drill received")
        await asyncio.to_thread(train, guard, range(4, 6))

        def nan_reports() -> list[StepReport]:
            return [r for r in tap.of(StepReport) if r.loss is not None and math.isnan(r.loss)]

        await wait_until(nan_reports, what="a NaN loss reported")
        assert [r.step for r in nan_reports()] == [4] and nan_reports()[0].nonfinite == 1
        await bus.publish_durable(s.cmd_all(job), Command(
            id="boom", job=job, kind="crash", issuer="cli",
            params={"message": "uncorrectable ECC error encountered"}))
        await wait_until(lambda: len(guard.commands.inbox) == 1, what="crash drill received")
        with pytest.raises(DrillCrash, match="uncorrectable ECC"):
            await asyncio.to_thread(train, guard, range(6, 10))
        await wait_until(lambda: len(tap.acks) == 3, what="acks")
        guard.close()
    assert [a.outcome for a in tap.acks] == ["failed", "done", "done"]


async def test_a_nats_outage_never_blocks_the_loop_and_publishing_resumes(
        private_nats: NatsServer, prefix: str, job: str) -> None:
    guard = make_guard(private_nats.url, prefix, job)
    async with tapped(private_nats.url, prefix, job) as (tap, _):
        outage_started = threading.Event()
        restarted = threading.Event()

        def between(i: int) -> None:
            if i == 20:
                private_nats.kill()
                outage_started.set()
            if i == 60:
                private_nats.start()
                restarted.set()

        durations = await asyncio.to_thread(train, guard, range(120), 0.005, between)
        await wait_until(lambda: any(r.step >= 110 for r in tap.of(StepReport)), timeout=30,
                         what="reports after the restart")
        guard.close()
    # Generous bound: a 6 ms step must never wait on the bus (a blocked publish or a
    # reconnect attempt would take ~0.5-2 s).
    assert max(durations) < 0.25, max(durations)
    assert guard.stats()["sent"] > 0


async def test_a_dead_url_costs_the_loop_nothing(prefix: str, job: str) -> None:
    dead = f"nats://127.0.0.1:{free_port()}"
    guard = make_guard(dead, prefix, job)
    durations = await asyncio.to_thread(train, guard, range(100), 0.002)
    t0 = time.monotonic()
    guard.close(timeout=1.0)
    assert time.monotonic() - t0 < 3.0
    assert max(durations) < 0.25
    assert guard.resume_point(timeout=0.2) is None
    assert guard.stats()["connected"] is False


def test_bad_identity_is_a_clear_value_error() -> None:
    with pytest.raises(ValueError, match="invalid job"):
        Guard(job="my job", rank=0, world_size=1)
    with pytest.raises(ValueError, match="needs a job name"):
        Guard(rank=0, world_size=1)
    with pytest.raises(ValueError, match="below the world size"):
        Guard(job="j", rank=4, world_size=4)
    with pytest.raises(ValueError, match="RANK='zero' is not an integer"):
        resolve_identity("j", None, None, None, env={"RANK": "zero"})
    ident = resolve_identity(None, None, None, None, env={
        "TRAINGUARD_JOB": "llama", "RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
        "TRAINGUARD_HOST": "node-b", "TORCHELASTIC_RESTART_COUNT": "2"})
    assert (ident.job, ident.rank, ident.world_size, ident.local_rank, ident.host) == (
        "llama", 3, 8, 1, "node-b")
    assert ident.attempt.restart_count == 2



RANK_IN_DATA = """
import hashlib, sys, time
from trainguard import Guard

job, url, prefix, loader = sys.argv[1:5]
guard = Guard(job=job, rank=0, world_size=1, host="node-t", nats_url=url, prefix=prefix,
              heartbeat_interval=3600.0 if loader == "stuck" else 0.5)
for i in range(20):
    with guard.step(i) as s, s.phase("compute"):
        time.sleep(0.01)
with guard.step(20) as s, s.phase("data"):
    if loader == "stuck":
        sys.stdin.read()  # a loader waiting on a worker that never answers
    with open(sys.executable, "rb") as f:
        while True:  # a loader refilling: reading and decoding
            f.seek(0)
            hashlib.sha256(f.read(1 << 20)).digest()
"""


@pytest.mark.parametrize("loader", ["stuck", "refilling"])
async def test_a_loader_that_does_no_work_says_so_at_once_and_one_that_works_never_does(
        nats_url: str, prefix: str, job: str, loader: str) -> None:
    """A rank's own process in ``data``: stuck, its heartbeat says it did no work for a
    second, sent at once (the regular beats are an hour apart); refilling, its beats over
    2.5 s never say so."""
    async with tapped(nats_url, prefix, job) as (tap, _):
        rank = await asyncio.create_subprocess_exec(
            sys.executable, "-c", RANK_IN_DATA, job, nats_url, prefix, loader,
            stdin=asyncio.subprocess.PIPE)
        try:
            def in_data() -> list[Heartbeat]:
                return [h for h in tap.of(Heartbeat) if h.step == 20 and h.phase == "data"]

            if loader == "stuck":
                quiet = await wait_until(
                    lambda: [h for h in in_data() if h.quiet_for >= QUIET_BEAT_S],
                    timeout=30, what="a beat saying the loader did no work for a second")
                assert quiet[0].quiet_for <= quiet[0].phase_elapsed
            else:
                await wait_until(lambda: [h for h in in_data() if h.phase_elapsed >= 2.5],
                                 timeout=30, what="beats from 2.5 s into the refill")
                assert {h.quiet_for for h in in_data()} == {0.0}
        finally:
            rank.kill()
            await rank.wait()
