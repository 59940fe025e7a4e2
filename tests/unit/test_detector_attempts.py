"""Attempts are per node: torchrun's restart count is each agent's own.

After a few faults the demo's node-a ran at attempt 10 and node-b at 7 in one healthy
worker group (a group restarted for a membership change is not counted). Judged as one
job-wide number, node-b's ranks were "exited": a GPU anomaly on node-b named no rank, a
hang on node-a was attributed to node-b's ranks, and the coordinator waited for ranks it
thought gone. These tests drive the detector with such a job.
"""

from __future__ import annotations

from trainguard.contract.schemas import Heartbeat, NodeHeartbeat, NodeHello, StepReport
from trainguard.runtime.state import Progress, RankProgress
from trainguard.services.detector.engine import Detector
from trainguard.services.detector.job import RankInfo
from trainguard.services.detector.thresholds import Thresholds

T0 = 1_700_000_000.0
HOSTS = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}


class Job:
    """Four ranks on two hosts, each host with its own attempt, stepping together."""

    def __init__(self, attempts: dict[str, int]) -> None:
        self.now = T0
        self.d = Detector(Thresholds(), clock=lambda: self.now)
        self.attempts = dict(attempts)
        self.pids = {r: 100 + r for r in HOSTS}
        self.step = 0

    def beat(self, phase: str = "compute", only: set[int] | None = None) -> None:
        for r, host in HOSTS.items():
            if only is None or r in only:
                self.d.on_telemetry(Heartbeat(
                    job="j", time=self.now, rank=r, attempt=self.attempts[host], host=host,
                    pid=self.pids[r], step=self.step, phase=phase))

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.now += 0.5
            self.beat()
            for r, host in HOSTS.items():
                self.d.on_telemetry(StepReport(
                    job="j", time=self.now, rank=r, step=self.step,
                    attempt=self.attempts[host], duration=0.5,
                    phases={"compute": 0.45, "comm": 0.05}, loss=2.0, grad_norm=1.0))
            self.step += 1
            self.d.tick(self.now)

    def states(self) -> dict[int, str]:
        progress = self.d.progress("j", self.now)
        assert progress is not None
        return {r: p.state for r, p in progress.ranks.items()}


def test_ranks_of_nodes_at_different_attempts_are_one_current_group() -> None:
    job = Job({"node-a": 10, "node-b": 7})
    job.steps(20)
    state = job.d.jobs["j"]
    assert sorted(r.rank for r in state.in_attempt()) == [0, 1, 2, 3]
    assert state.expected == 4
    assert job.states() == {0: "ok", 1: "ok", 2: "ok", 3: "ok"}
    assert job.d.drain() == []


def test_a_restart_on_the_lower_node_re_forms_the_job() -> None:
    job = Job({"node-a": 10, "node-b": 7})
    job.steps(20)
    state = job.d.jobs["j"]
    before = state.incarnation
    job.attempts["node-b"] = 8  # node-b counted the restart; node-a's count stayed
    job.step = 10  # resumed from a checkpoint: steps go back
    job.pids = {r: 200 + r for r in HOSTS}
    job.steps(20)
    assert state.incarnation > before
    assert sorted(r.rank for r in state.in_attempt()) == [0, 1, 2, 3]
    assert job.states() == {0: "ok", 1: "ok", 2: "ok", 3: "ok"}
    assert state.max_step == 29  # the new group's steps count, from the resume on
    assert [a.kind for a in (t.anomaly for t in job.d.drain())] == []


def test_a_frozen_rank_on_the_higher_node_is_the_hang_culprit() -> None:
    job = Job({"node-a": 10, "node-b": 7})
    job.steps(20)
    # SIGSTOP rank 1 on node-a: its agent reports state T; the others wait in comm.
    job.now += 0.5
    job.d.on_telemetry(NodeHeartbeat(job="j", time=job.now, host="node-a", attempt=10,
                                     ranks={0: "S", 1: "T"}, pids={0: 100, 1: 101}))
    job.beat("comm", only={0, 2, 3})
    job.d.tick(job.now)
    [hang] = [t.anomaly for t in job.d.drain() if t.anomaly.kind == "hang"]
    assert hang.ranks == [1] and hang.hosts == ["node-a"]
    assert job.states()[1] == "stopped"
    assert {r: s for r, s in job.states().items() if r != 1} == {0: "ok", 2: "ok", 3: "ok"}


def test_a_rank_that_closed_holds_the_hang_until_its_exit_names_the_crash() -> None:
    """On a busy machine a crashing rank says "closed" and then takes seconds to exit; its
    peers wait in the collective meanwhile. That wait is not a network hang: the exit, when
    it comes, is the crash. Without an exit, the hang is judged once ``exit_grace`` is over."""
    from trainguard.contract.schemas import WorkerExit

    for exit_comes in (True, False):
        job = Job({"node-a": 3, "node-b": 3})
        job.steps(30)
        job.now += 0.5
        job.beat("closed", only={1})
        for _ in range(20):  # 10 s: past the hang limit (5 s), within exit_grace (15 s)
            job.now += 0.5
            job.beat("comm", only={0, 2, 3})
            job.d.tick(job.now)
        assert [t.anomaly.kind for t in job.d.drain()] == []
        if exit_comes:
            job.d.on_exit(WorkerExit(id="x1", job="j", host="node-a", rank=1, attempt=3,
                                     exit_code=1, stderr_tail="RuntimeError: ECC",
                                     time=job.now), job.now)
            kinds = [t.anomaly.kind for t in job.d.drain()]
            assert kinds[0] == "crash"
        else:
            for _ in range(20):
                job.now += 0.5
                job.beat("comm", only={0, 2, 3})
                job.d.tick(job.now)
            assert "hang" in [t.anomaly.kind for t in job.d.drain()]


def test_an_agent_that_restarted_its_group_re_forms_the_job_before_its_ranks_speak() -> None:
    job = Job({"node-a": 3, "node-b": 5})
    job.steps(10)
    state = job.d.jobs["j"]
    before = job.d.progress("j", job.now)
    assert before is not None
    job.now += 0.5
    # node-a's agent restarted its group (attempt 4); its new ranks are still starting.
    job.d.on_telemetry(NodeHeartbeat(job="j", time=job.now, host="node-a",
                                     ranks={0: "S", 1: "S"}, pids={0: 300, 1: 301}, attempt=4))
    after = job.d.progress("j", job.now)
    assert after is not None and after.incarnation > before.incarnation
    assert state.host_attempt["node-a"] == 4
    # The new ranks' own word at that attempt is the same re-form, not another one.
    generation = state.incarnation
    job.attempts["node-a"] = 4
    job.step = 5
    job.steps(5)
    assert state.incarnation == generation
    assert job.states() == {0: "ok", 1: "ok", 2: "ok", 3: "ok"}
    # An agent's beat at the attempt already known changes nothing.
    job.d.on_telemetry(NodeHeartbeat(job="j", time=job.now, host="node-b",
                                     ranks={2: "S", 3: "S"}, pids={2: 102, 3: 103}, attempt=5))
    assert state.incarnation == generation


def test_the_progress_names_the_job_wide_generation_whatever_each_node_counts() -> None:
    """Nodes count their own restarts (node-a 10, node-b 7), but every host draws the
    group's generation from the rendezvous: the progress publishes the newest one its
    agents and ranks report, so the remediator numbers attempts the way exits do."""
    job = Job({"node-a": 10, "node-b": 7})
    job.steps(5)
    progress = job.d.progress("j", job.now)
    assert progress is not None and progress.generation == 0  # nobody said yet
    for host, ranks in (("node-a", {0: "S", 1: "S"}), ("node-b", {2: "S", 3: "S"})):
        job.d.on_telemetry(NodeHeartbeat(job="j", time=job.now, host=host, ranks=ranks,
                                         attempt=job.attempts[host], generation=12))
    progress = job.d.progress("j", job.now)
    assert progress is not None and progress.generation == 12
    job.now += 0.5  # a late beat of an older group never takes it back
    job.d.on_telemetry(NodeHeartbeat(job="j", time=job.now, host="node-b",
                                     ranks={2: "S", 3: "S"}, attempt=7, generation=11))
    progress = job.d.progress("j", job.now)
    assert progress is not None and progress.generation == 12
    successor = Detector(Thresholds(), clock=lambda: job.now)  # a detector taking it over
    successor.restore("j", {}, progress, job.now)
    again = successor.progress("j", job.now)
    assert again is not None and again.generation == 12


def test_a_job_launched_again_numbers_its_generations_anew() -> None:
    """Every launcher of the job started again (a new rendezvous): its generations start
    over, and the progress follows them rather than the old run's newest."""
    job = Job({"node-a": 0, "node-b": 0})
    job.steps(2)
    for host in ("node-a", "node-b"):
        job.d.on_telemetry(NodeHeartbeat(job="j", time=job.now, host=host, attempt=0,
                                         generation=30))
        job.d.on_node_hello(NodeHello(job="j", host=host, left=True, time=job.now), job.now)
    for host in ("node-a", "node-b"):
        job.d.on_node_hello(NodeHello(job="j", host=host, time=job.now + 60), job.now + 60)
        job.d.on_telemetry(NodeHeartbeat(job="j", time=job.now + 61, host=host, attempt=0,
                                         generation=1))
    progress = job.d.progress("j", job.now + 61)
    assert progress is not None and progress.generation == 1


def test_a_large_job_taken_over_is_admitted_in_linear_time() -> None:
    """A detector taking over 16,384 ranks on 2,048 hosts (each host seen for the first
    time) counts each rank once: a recount per new host made it quadratic, 3.5 s of the
    new owner's loop at that size (bench/bench_failover.py)."""
    ranks, per_host = 4096, 8
    progress = Progress(job="j", time=T0, world_size=ranks, last_step=10, ranks={
        r: RankProgress(rank=r, host=f"node-{r // per_host}", step=10, last_seen=T0)
        for r in range(ranks)})
    successor = Detector(Thresholds(), clock=lambda: T0)
    state = successor.job("j")
    looked = 0
    judge = state.current

    def counted(r: RankInfo) -> bool:
        nonlocal looked
        looked += 1
        return judge(r)

    state.current = counted  # type: ignore[method-assign]
    successor.restore("j", {}, progress, T0)
    assert len(state.ranks) == ranks and state.active_count == ranks
    assert state.expected == ranks
    assert looked <= ranks, f"{looked} rank looks to admit {ranks} ranks"
