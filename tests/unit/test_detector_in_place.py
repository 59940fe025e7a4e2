"""The detector and in-place recovery: a group re-forming around a replacement is not a
hang (for a bounded time), a crashed rank replaced by a new process at the same attempt
ends its crash, and a rollback in place (steps going back, no new process) starts the
job's steps and baselines over like a resume."""

from __future__ import annotations

from tests.unit.test_detector_attempts import HOSTS, Job
from trainguard.contract.schemas import (
    RECOVERING_PHASE,
    Attempt,
    Heartbeat,
    NodeHeartbeat,
    RankHello,
    StepReport,
    WorkerExit,
)


def kinds(job: Job) -> list[tuple[str, str]]:
    return [(t.anomaly.kind, t.anomaly.status) for t in job.d.drain()]


def crash_rank_2(job: Job) -> None:
    job.d.on_exit(WorkerExit(id="x", job="j", host="node-b", rank=2, pid=job.pids[2],
                             exit_code=-9, signal="SIGKILL", attempt=job.attempts["node-b"],
                             time=job.now), job.now)


def hello(job: Job, rank: int, world: int, t: float, host: str = "",
          pid: int = 0) -> None:
    """``rank`` says hello at world size ``world``, sent at ``t`` (host and pid: its own by
    default, the process's after a renumbering)."""
    job.d.on_hello(RankHello(job="j", rank=rank, world_size=world, host=host or HOSTS[rank],
                             pid=pid or job.pids[rank], attempt=Attempt(restart_count=0),
                             time=t), job.now)


def step_on(job: Job, ranks: dict[int, tuple[str, int]], world: int) -> None:
    """``ranks`` (rank -> host, pid) beat and step for 20 s, far past every silence and hang
    threshold, in a group of ``world``."""
    for _ in range(40):
        job.now += 0.5
        for r, (host, pid) in ranks.items():
            job.d.on_telemetry(Heartbeat(job="j", time=job.now, rank=r, attempt=0, host=host,
                                         pid=pid, step=job.step, phase="compute"))
            job.d.on_telemetry(StepReport(job="j", time=job.now, rank=r, step=job.step,
                                          attempt=0, duration=0.5, world_size=world,
                                          phases={"compute": 0.45, "comm": 0.05}, loss=2.0,
                                          grad_norm=1.0))
        job.step += 1
        job.d.tick(job.now)


def wait_recovering(job: Job, seconds: float, survivors: set[int],
                    since: float | None = None) -> float:
    """The survivors beat in ``recovering`` (since ``since``) for ``seconds``; no step
    completes. Returns when their recovery began."""
    began = job.now if since is None else since
    end = job.now + seconds
    while job.now < end:
        job.now += 0.5
        for r in survivors:
            host = HOSTS[r]
            job.d.on_telemetry(Heartbeat(
                job="j", time=job.now, rank=r, attempt=job.attempts[host], host=host,
                pid=job.pids[r], step=job.step, phase=RECOVERING_PHASE,
                phase_elapsed=job.now - began))
        job.d.tick(job.now)
    return began


def test_survivors_recovering_in_place_are_not_a_hang_for_a_while() -> None:
    job = Job({"node-a": 0, "node-b": 0})
    job.steps(30)
    crash_rank_2(job)
    assert kinds(job) == [("crash", "open")]
    limit = job.d.jobs["j"].th.recovery_timeout
    began = wait_recovering(job, 30.0, {0, 1, 3})  # far past the 5 s hang floor
    assert kinds(job) == []
    wait_recovering(job, limit, {0, 1, 3}, began)  # a recovery that never ends is judged
    assert ("hang", "open") in kinds(job)


def test_a_crashed_rank_replaced_at_the_same_attempt_ends_its_crash() -> None:
    job = Job({"node-a": 0, "node-b": 0})
    job.steps(30)
    state = job.d.jobs["j"]
    generation = state.incarnation
    crash_rank_2(job)
    wait_recovering(job, 2.0, {0, 1, 3})
    job.pids[2] = 999  # the replacement: a warm spare's pid, same attempt
    job.steps(5)
    assert kinds(job) == [("crash", "open"), ("crash", "resolved")]
    assert state.incarnation == generation  # the survivors never re-formed their job
    assert sorted(r.rank for r in state.in_attempt()) == [0, 1, 2, 3]
    assert job.states() == {0: "ok", 1: "ok", 2: "ok", 3: "ok"}


def test_the_gap_of_a_recovery_in_place_does_not_raise_the_hang_limit() -> None:
    """A 6 s recovery between two steps is not a step interval: the next hang is judged
    by the steps (3 x their p99), not at 3 x the recovery (18 s)."""
    from trainguard.services.detector.engine import LIVENESS

    job = Job({"node-a": 0, "node-b": 0})
    job.steps(30)
    crash_rank_2(job)
    wait_recovering(job, 6.0, {0, 1, 3})
    job.pids[2] = 999
    job.steps(60)
    state = job.d.jobs["j"]
    limit, basis = LIVENESS.hang_limit(state)
    assert basis in ("hang_floor", "p99") and limit < 3.0  # 3 x the 0.5 s steps at most


def test_a_rollback_in_place_starts_the_steps_and_baselines_over() -> None:
    job = Job({"node-a": 0, "node-b": 0})
    job.steps(80)  # past the numeric warm-up: the baselines are learned
    state, numerics = job.d.jobs["j"], job.d.rules["j"].numerics
    generation, restarts = state.incarnation, numerics.restarts
    job.step = 40  # every rank reloaded the checkpoint of step 39, same processes
    for _ in range(10):  # the re-run steps are judged, not dropped as already closed
        job.now += 0.5
        for r, host in HOSTS.items():
            job.d.on_telemetry(Heartbeat(job="j", time=job.now, rank=r,
                                         attempt=job.attempts[host], host=host,
                                         pid=job.pids[r], step=job.step, phase="compute"))
            job.d.on_telemetry(StepReport(job="j", time=job.now, rank=r, step=job.step,
                                          attempt=0, duration=0.5, loss=5.0, grad_norm=9.0,
                                          phases={"compute": 0.45, "comm": 0.05}))
        job.step += 1
        job.d.tick(job.now)
    assert state.incarnation == generation + 1  # once, not once per rank
    assert numerics.restarts == restarts + 1
    assert state.max_step == 49
    assert kinds(job) == []  # a new baseline: the other loss is no spike, nor a hang


def test_a_host_that_left_in_place_takes_its_ranks_out_of_the_job() -> None:
    """node-b is isolated (its exits are the command's) and node-a's ranks say hello at
    world size 2: ranks 2-3 are gone, not silent; nothing is raised and the job steps on
    with two."""
    job = Job({"node-a": 0, "node-b": 0})
    for r in HOSTS:
        hello(job, r, 4, job.now)
    job.steps(10)
    job.d.drain()
    for r in (2, 3):
        job.d.on_exit(WorkerExit(id=f"x{r}", job="j", host="node-b", rank=r, pid=job.pids[r],
                                 exit_code=-15, signal="SIGTERM", initiated_by="c1",
                                 attempt=0, time=job.now), job.now)
    for r in (0, 1):
        hello(job, r, 2, job.now)
    state = job.d.jobs["j"]
    assert sorted(state.ranks) == [0, 1] and state.expected == 2
    # An agent that has not caught up yet still names a gone rank: it is not admitted.
    job.d.on_telemetry(NodeHeartbeat(job="j", host="node-b", time=job.now, attempt=0,
                                     ranks={2: "R"}))
    assert sorted(state.ranks) == [0, 1]
    step_on(job, {r: ("node-a", job.pids[r]) for r in (0, 1)}, world=2)
    assert kinds(job) == []
    assert job.states() == {0: "ok", 1: "ok"}


def test_a_renumbered_rank_s_late_reports_as_its_old_number_are_not_a_new_rank() -> None:
    """Rank 1 (node-a) left in place and node-b's ranks 2-3 closed up the gap as 1-2 of 3.
    Rank 0's hello at world size 3 came first; node-b's process then beat once more as rank
    3 before it renumbered, and a step report of its old number was late: number 3 went,
    and stays gone (it was once raised ``unresponsive`` when that beat re-admitted it)."""
    job = Job({"node-a": 0, "node-b": 0})
    for r in HOSTS:
        hello(job, r, 4, job.now)
    job.steps(10)
    job.d.drain()
    state = job.d.jobs["j"]
    hello(job, 0, 3, job.now)
    assert sorted(state.ranks) == [0, 1, 2]
    job.now += 0.2
    job.d.on_telemetry(Heartbeat(job="j", time=job.now, rank=3, attempt=0, host="node-b",
                                 pid=job.pids[3], step=job.step, phase="comm"))
    job.d.on_telemetry(StepReport(job="j", time=job.now - 1.0, rank=3, step=job.step - 1,
                                  attempt=0, duration=0.5, world_size=4))
    assert sorted(state.ranks) == [0, 1, 2]
    group = {0: ("node-a", job.pids[0]), 1: ("node-b", job.pids[2]),
             2: ("node-b", job.pids[3])}
    for r in (1, 2):
        hello(job, r, 3, job.now + 0.1, *group[r])
    step_on(job, group, world=3)
    assert kinds(job) == []
    assert sorted(state.ranks) == [0, 1, 2] and state.expected == 3


def test_a_rank_a_grow_adds_is_admitted_by_the_hello_that_declares_it() -> None:
    """The group went on at 2 (node-b left) and grows back to 4: the new ranks' beats before
    their hellos are not yet of the job, their hellos at world size 4 admit them, and a
    late hello at the old size (before the shrink) admits nothing."""
    job = Job({"node-a": 0, "node-b": 0})
    for r in HOSTS:
        hello(job, r, 4, job.now)
    job.steps(5)
    shrunk = job.now
    for r in (0, 1):
        hello(job, r, 2, shrunk)
    state = job.d.jobs["j"]
    assert sorted(state.ranks) == [0, 1]
    hello(job, 2, 4, shrunk - 5.0)  # sent before the shrink, delivered after it
    assert sorted(state.ranks) == [0, 1]
    job.now += 3.0
    job.pids.update({2: 302, 3: 303})
    job.beat(only={2, 3})
    assert sorted(state.ranks) == [0, 1]
    for r in HOSTS:
        hello(job, r, 4, job.now)
    job.steps(5)
    assert sorted(state.ranks) == [0, 1, 2, 3] and state.expected == 4
    assert job.states() == {0: "ok", 1: "ok", 2: "ok", 3: "ok"}


def test_reports_about_a_numbers_previous_process_leave_its_new_holder_alone() -> None:
    """node-b (rank 2) left and node-c's process closed up the gap as rank 2: node-b's late
    exit and node heartbeat for rank 2 are about its own process, not node-c's."""
    job = Job({"node-a": 0, "node-b": 0})
    job.steps(5)
    state = job.d.jobs["j"]
    r = state.ranks[2]
    r.host, r.pid = "node-c", 900  # what node-c's heartbeats as rank 2 made of it
    job.d.drain()
    job.d.on_exit(WorkerExit(id="late", job="j", host="node-b", rank=2, pid=102,
                             exit_code=-15, signal="SIGTERM", initiated_by="c1", attempt=0,
                             time=job.now), job.now)
    job.d.on_telemetry(NodeHeartbeat(job="j", host="node-b", time=job.now, attempt=0,
                                     ranks={2: "X"}, pids={2: 102}))
    assert not r.exited and r.proc_state != "X" and r.host == "node-c"
    # The holder's own exit still counts.
    job.d.on_exit(WorkerExit(id="own", job="j", host="node-c", rank=2, pid=900,
                             exit_code=1, attempt=0, time=job.now), job.now)
    assert r.exited and ("crash", "open") in kinds(job)


def test_a_late_hello_of_a_smaller_world_does_not_drop_live_ranks() -> None:
    job = Job({"node-a": 0, "node-b": 0})
    for rank in HOSTS:
        hello(job, rank, 4, job.now)
    hello(job, 0, 2, job.now - 30)
    assert sorted(job.d.jobs["j"].ranks) == [0, 1, 2, 3]


def test_an_exit_reported_after_its_replacement_spoke_is_the_old_process_s() -> None:
    """The replacement of rank 2 beats before the agent's report of the old process's exit
    reaches the detector (two subjects, no order between them). The report is about the old
    pid: its crash is raised, and ends, but the replacement stays a live rank, so that its
    own faults are judged (here SIGSTOP: a hang at once, naming rank 2)."""
    job = Job({"node-a": 0, "node-b": 0})
    job.steps(30)
    old = job.pids[2]
    job.pids[2] = 999  # the replacement, same attempt, already beating and stepping
    job.steps(3)
    job.d.on_exit(WorkerExit(id="x", job="j", host="node-b", rank=2, pid=old,
                             exit_code=-9, signal="SIGKILL", attempt=job.attempts["node-b"],
                             time=job.now - 1.0), job.now)
    job.steps(1)
    assert kinds(job) == [("crash", "open"), ("crash", "resolved")]
    state = job.d.jobs["j"]
    assert sorted(r.rank for r in state.in_attempt()) == [0, 1, 2, 3]
    job.now += 0.1
    job.d.on_telemetry(NodeHeartbeat(job="j", host="node-b", time=job.now, attempt=0,
                                     ranks={2: "T", 3: "S"}, pids={2: 999, 3: job.pids[3]}))
    hangs = [t.anomaly for t in job.d.drain() if t.anomaly.kind == "hang"]
    assert [(a.status, a.ranks) for a in hangs] == [("open", [2])]


def test_an_exit_the_agent_commanded_after_the_replacement_spoke_leaves_it_live() -> None:
    """A hang's culprit killed by command (``initiated_by``), its exit reported after its
    replacement's first beat: no crash, and the replacement is not taken for gone."""
    job = Job({"node-a": 0, "node-b": 0})
    job.steps(30)
    old = job.pids[1]
    job.pids[1] = 777
    job.steps(2)
    job.d.on_exit(WorkerExit(id="x", job="j", host="node-a", rank=1, pid=old,
                             exit_code=-9, signal="SIGKILL", initiated_by="c1",
                             attempt=job.attempts["node-a"], time=job.now - 0.5), job.now)
    assert kinds(job) == []
    state = job.d.jobs["j"]
    assert not state.ranks[1].exited and state.expected == 4


def test_a_node_beat_taken_before_the_replacement_spoke_does_not_judge_it() -> None:
    """The agent's beat that still saw the old process gone arrives after the replacement's
    first heartbeat: it is about the old pid, so the replacement is not taken for a crash."""
    job = Job({"node-a": 0, "node-b": 0})
    job.steps(30)
    old = job.pids[2]
    job.pids[2] = 999
    job.steps(1)
    job.d.on_telemetry(NodeHeartbeat(job="j", host="node-b", time=job.now - 0.3, attempt=0,
                                     ranks={2: "X", 3: "S"}, pids={2: old, 3: job.pids[3]}))
    job.steps(30)  # far past hb_timeout
    assert kinds(job) == []
    assert job.d.jobs["j"].ranks[2].proc_state != "X"
