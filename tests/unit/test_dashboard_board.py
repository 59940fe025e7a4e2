"""The dashboard's board: pure state fed messages, read as the snapshot the page renders."""

from __future__ import annotations

from trainguard.contract.schemas import (
    CheckpointCommitted,
    Heartbeat,
    Incident,
    IncidentStep,
    NodeHeartbeat,
    StepReport,
)
from trainguard.dashboard.board import Board, compute_time

T0 = 1_000_000.0


def step(rank: int, n: int, compute: float, *, job: str = "j", comm: float = 0.05,
         t: float | None = None) -> StepReport:
    return StepReport(job=job, rank=rank, step=n, time=t if t is not None else T0 + n * 0.2,
                      duration=compute + comm + 0.01,
                      phases={"data": 0.01, "compute": compute, "comm": comm})


def fed(ranks: int = 4, steps: int = 20, slow: int | None = 1) -> Board:
    b = Board()
    for n in range(steps):
        for r in range(ranks):
            # Step 0 is slow for everyone (warm-up): no rank should look slow for it.
            c = (0.5 if n == 0 else 0.1) * (2.5 if r == slow else 1.0)
            b.telemetry(step(r, n, c))
    return b


def test_compute_time_leaves_the_collective_wait_out() -> None:
    assert round(compute_time(step(0, 1, 0.1, comm=0.3)), 3) == 0.11


def test_the_slow_rank_is_the_slowest_row_and_each_step_is_judged_on_its_own() -> None:
    snap = fed().snapshot(T0)["jobs"][0]
    rows = {r["rank"]: r for r in snap["ranks"]}
    assert [r for r in rows if rows[r].get("slowest")] == [1]
    assert rows[1]["ratio"] == round(0.26 / 0.11, 2) and rows[0]["ratio"] == 1.0  # data too
    assert rows[0]["steps"][0]["ratio"] == 1.0  # the warm-up step was slow for all
    assert len(rows[0]["steps"]) == 20
    none_slow = fed(slow=None).snapshot(T0)["jobs"][0]
    assert not any(r.get("slowest") for r in none_slow["ranks"])


def test_stuck_in_its_own_phase_versus_waiting_in_the_collective() -> None:
    b = fed(slow=None)
    b.telemetry(Heartbeat(job="j", rank=2, time=T0 + 9, phase="data", phase_elapsed=8.0))
    for r in (0, 1, 3):
        b.telemetry(Heartbeat(job="j", rank=r, time=T0 + 9, phase="comm", phase_elapsed=7.5))
    rows = {r["rank"]: r for r in b.snapshot(T0)["jobs"][0]["ranks"]}
    assert [r for r in rows if rows[r]["stuck"]] == [2]
    assert [r for r in rows if rows[r]["waiting"]] == [0, 1, 3]
    # A stopped process (SIGSTOP) is stuck whatever its last phase was.
    b.telemetry(NodeHeartbeat(job="j", host="node-a", time=T0 + 10, ranks={0: "T", 1: "S"}))
    rows = {r["rank"]: r for r in b.snapshot(T0)["jobs"][0]["ranks"]}
    assert [r for r in rows if rows[r]["stuck"]] == [0, 2]


def test_a_restart_starts_the_rank_row_again_and_goodput_counts_steps_once() -> None:
    b = fed(ranks=2, steps=10, slow=None)
    job = b.snapshot(T0)["jobs"][0]
    assert job["goodput"] is not None and 0 < job["goodput"] <= 1
    for r in range(2):  # the job went back to step 5
        b.telemetry(step(r, 5, 0.1, t=T0 + 30))
    job = b.snapshot(T0)["jobs"][0]
    assert [s["step"] for s in job["ranks"][0]["steps"]] == [5]
    wall = 30.0
    assert job["goodput"] == round(10 * job["median_step"] / wall, 3)  # steps 0-9 once


def test_incidents_keep_their_newest_revision_and_checkpoints_their_line() -> None:
    b = fed(ranks=2, steps=30, slow=None)
    inc = Incident(id="i1", job="j", cause="rank_hang", status="mitigating", rev=3,
                   ranks=[1], hosts=["node-b"], onset_at=T0, detected_at=T0 + 5,
                   actions=[IncidentStep(action="dump", status="done", at=T0 + 6)])
    b.event(inc)
    b.event(Incident(id="i1", job="j", cause="rank_hang", status="open", rev=1))  # late
    b.event(CheckpointCommitted(id="c1", job="j", step=10, path="/c/10"))
    b.event(CheckpointCommitted(id="c2", job="j", step=20, path="/c/20", status="suspect"))
    job = b.snapshot(T0)["jobs"][0]
    (row,) = job["incidents"]
    assert (row["status"], row["detect_s"], row["actions"][0]["action"]) == \
        ("mitigating", 5.0, "dump")
    assert job["open_incidents"] == 1
    assert (job["checkpoints"], job["last_checkpoint"], job["last_step"]) == ([10], 10, 29)


def test_one_job_only_and_version_moves_on_news() -> None:
    b = Board(only_job="j")
    before = b.version
    b.telemetry(step(0, 1, 0.1, job="other"))
    assert b.version == before and b.snapshot(T0)["jobs"] == []
    b.telemetry(step(0, 1, 0.1))
    assert b.version > before and [j["job"] for j in b.snapshot(T0)["jobs"]] == ["j"]
