"""Crash, unresponsive and hang rules on synthetic streams (pure: no bus, simulated time)."""

from __future__ import annotations

from trainguard.contract.schemas import Attempt, NodeHeartbeat, RankHello, StepReport, WorkerExit
from trainguard.services.detector.synthetic import Harness, SimConfig
from trainguard.services.detector.thresholds import Thresholds

TICK = 0.25


def harness(ranks: int = 8, **th: object) -> Harness:
    return Harness(Thresholds(**th), SimConfig(ranks=ranks, ranks_per_host=4), tick_every=TICK)  # type: ignore[arg-type]


def exit_of(h: Harness, rank: int, *, code: int | None = 1, signal: str | None = None,
            initiated_by: str | None = None, ident: str = "e1", attempt: int = 0) -> WorkerExit:
    return WorkerExit(id=ident, job=h.sim.cfg.job, host=h.sim.host(rank), rank=rank,
                      exit_code=code, signal=signal, initiated_by=initiated_by,
                      attempt=attempt, time=h.clock, error="RuntimeError: CUDA error")


def test_worker_exit_is_a_crash_naming_rank_and_host_once() -> None:
    h = harness()
    h.sim.steps(20)
    h.detector.on_exit(exit_of(h, 3), h.clock)
    h.detector.on_exit(exit_of(h, 3), h.clock)  # redelivered: same incarnation, same crash
    [crash] = h.collect()
    assert crash.kind == "crash" and crash.ranks == [3] and crash.hosts == ["node-0"]
    assert crash.severity == "critical" and crash.step == 19
    assert crash.evidence.exit_code == 1 and "CUDA" in crash.evidence.error
    assert crash.detected_at - crash.onset_at < 1.0
    # The crashed rank falls silent: that is expected now, not "unresponsive".
    h.sim.silent.add(3)
    h.sim.steps(30)
    assert h.opened() == [crash]
    # It comes back as a new attempt: the crash resolves, same id, next revision.
    h.sim.silent.clear()
    h.sim.attempt = 1
    h.sim.steps(3)
    [resolved] = h.resolved("crash")
    assert (resolved.id, resolved.rev, resolved.status) == (crash.id, 2, "resolved")


def test_initiated_and_clean_exits_are_not_crashes() -> None:
    h = harness()
    h.sim.steps(10)
    h.detector.on_exit(exit_of(h, 1, initiated_by="launcher", ident="e1"), h.clock)
    h.detector.on_exit(exit_of(h, 2, code=0, ident="e2"), h.clock)
    h.detector.on_exit(exit_of(h, 4, code=None, signal="SIGKILL", ident="e3"), h.clock)
    [crash] = h.collect()
    assert crash.ranks == [4] and crash.evidence.signal == "SIGKILL"


def test_exit_with_neither_code_nor_signal_is_the_agents_confirmation_of_a_crash() -> None:
    h = harness()
    h.sim.steps(5)
    h.detector.on_exit(exit_of(h, 6, code=None), h.clock)
    [crash] = h.collect()
    assert crash.ranks == [6] and crash.evidence.confirmed_gone is True


def test_silence_is_unresponsive_per_host_and_resolves_when_beats_return() -> None:
    h = harness(ranks=8, hb_timeout=5.0)
    h.sim.steps(30)
    h.sim.silent.add(5)
    started = h.clock
    h.sim.steps(40)
    [alert] = h.opened()
    assert alert.kind == "unresponsive" and alert.ranks == [5] and alert.hosts == ["node-1"]
    assert alert.severity == "warning"
    assert alert.detected_at - alert.onset_at <= 5.0 + 1.0 + TICK
    assert alert.onset_at <= started + 1.0
    assert not h.opened("crash") and not h.opened("hang")
    h.sim.silent.clear()
    h.sim.steps(5)
    [resolved] = h.resolved()
    assert resolved.id == alert.id and resolved.rev == 2


def test_a_second_silent_rank_of_the_host_widens_the_same_anomaly() -> None:
    h = harness(ranks=8)
    h.sim.steps(20)
    h.sim.silent.add(4)
    h.sim.steps(30)
    h.sim.silent.add(6)
    h.sim.steps(30)
    revs = [(a.id, a.rev, a.ranks) for a in h.events]
    assert revs == [("a1", 1, [4]), ("a1", 2, [4, 6])]


def test_no_silence_judgement_for_one_hb_timeout_after_the_detectors_reconnect() -> None:
    for reconnect_grace in (False, True):
        h = harness(ranks=8, hb_timeout=5.0)
        h.sim.steps(30)
        h.muted = True  # the detector is cut off from NATS for 20 s: it hears nothing
        h.sim.steps(60)
        h.muted = False
        if reconnect_grace:
            h.detector.grace(h.clock)
        h.sim.steps(10)
        if reconnect_grace:
            assert h.events == []
        else:
            assert h.opened("unresponsive"), "without the grace, stale silence would alert"


def test_late_buffered_heartbeats_do_not_count_as_recent() -> None:
    """A rank's own reconnect delivers old beats late: judged by sender time, still silent."""
    h = harness(ranks=4, hb_timeout=5.0)
    h.sim.steps(20)
    h.sim.silent.add(2)
    h.sim.steps(30)
    [alert] = h.opened()
    job = h.job
    late = job.ranks[2].last_hb + 0.5
    from trainguard.contract.schemas import Heartbeat

    h.feed(Heartbeat(job=h.sim.cfg.job, time=late, rank=2, host="node-0", step=5))
    h.tick(h.clock + TICK)
    assert h.resolved() == [] and alert.kind == "unresponsive"


def test_hang_with_heartbeats_names_the_rank_whose_phase_differs_once() -> None:
    h = harness(ranks=8)
    h.sim.steps(100)
    stalled_at = h.clock
    h.sim.stall(60.0, lambda r: "data" if r == 3 else "comm")
    [hang] = h.opened()
    assert hang.kind == "hang" and hang.ranks == [3] and hang.hosts == ["node-0"]
    ev = hang.evidence
    assert ev.majority_phase == "comm" and ev.culprit_basis == "phase"
    assert ev.phases["3"].phase == "data" and ev.phases["0"].phase == "comm"
    assert ev.phases["3"].elapsed > 3.0
    assert ev.limit == 5.0 and ev.phase_counts == {"comm": 7, "data": 1}
    assert hang.detected_at - stalled_at <= ev.limit + TICK + 0.5
    assert len(h.events) == 1, "a minute-long hang is one event"
    h.sim.steps(2)
    [resolved] = h.resolved()
    assert resolved.id == hang.id and resolved.rev == 2
    assert resolved.evidence.resumed_step == 100


def test_hang_limit_follows_k_times_p99_of_slow_steps() -> None:
    h = Harness(Thresholds(hang_floor=5.0, hang_k=3.0),
                SimConfig(ranks=4, compute=4.0, jitter=0.01), tick_every=TICK)
    h.sim.steps(40)
    h.sim.stall(11.0, lambda r: "data" if r == 0 else "comm")
    assert h.events == [], "11 s is under 3 x a 4 s step"
    h.sim.stall(5.0, lambda r: "data" if r == 0 else "comm")
    [hang] = h.opened()
    assert hang.ranks == [0] and hang.evidence.limit_basis == "p99"
    assert 12.0 < hang.evidence.limit < 13.5


def test_hang_with_every_rank_in_comm_blames_the_rank_behind_in_collectives() -> None:
    h = harness(ranks=4)
    h.sim.steps(50)
    h.sim.coll_lag[2] = 1
    h.sim.stall(10.0, lambda r: "comm")
    [hang] = h.opened()
    assert hang.ranks == [2] and hang.evidence.culprit_basis == "coll_seq"


def test_hang_with_every_rank_alike_names_all_and_no_culprit() -> None:
    h = harness(ranks=4)
    h.sim.steps(50)
    h.sim.stall(10.0, lambda r: "comm")
    [hang] = h.opened()
    assert hang.ranks == [0, 1, 2, 3] and hang.evidence.culprits == []
    assert hang.evidence.culprit_basis == "none"


def test_a_long_checkpoint_is_not_a_hang_but_one_far_beyond_the_learned_ones_is() -> None:
    cfg = SimConfig(ranks=8, checkpoint_every=50, checkpoint_seconds=(9.0, 11.0))
    h = Harness(Thresholds(), cfg, tick_every=TICK)
    h.sim.steps(201)  # four checkpoints of ~10 s: far beyond the 5 s floor, yet normal
    assert h.events == []
    h.sim.stall(45.0, lambda r: "checkpoint")
    kinds = [a.kind for a in h.opened()]
    assert kinds == ["checkpoint_slow", "hang"], kinds
    slow, hang = h.opened()
    assert slow.evidence.source == "heartbeat" and 16.0 <= slow.evidence.threshold < 24.0
    assert hang.evidence.limit_basis == "phase:checkpoint"
    assert 27.0 < hang.evidence.limit < 36.0


def test_first_long_phase_uses_the_long_phase_floor() -> None:
    h = harness(ranks=4, long_phase_floor=120.0)
    h.sim.steps(50)
    h.sim.stall(100.0, lambda r: "eval")
    assert h.events == []
    h.sim.stall(30.0, lambda r: "eval")
    [hang] = h.opened()
    assert hang.evidence.limit == 120.0


def test_start_up_uses_its_own_longer_grace() -> None:
    h = harness(ranks=4, startup_grace=60.0)
    h.sim.stall(50.0, lambda r: "init")
    assert h.events == []
    h.sim.stall(20.0, lambda r: "init")
    [hang] = h.opened()
    assert hang.evidence.limit_basis == "startup_grace" and hang.step is None


def node_beat(h: Harness, states: dict[int, str], host: str = "node-0") -> NodeHeartbeat:
    return NodeHeartbeat(job=h.sim.cfg.job, time=h.clock, host=host, ranks=states)


def test_stopped_rank_is_a_hang_at_once_naming_it() -> None:
    h = harness(ranks=4)
    h.sim.steps(20)
    h.feed(node_beat(h, {0: "R", 1: "T", 2: "S", 3: "R"}))
    [hang] = h.opened()
    assert hang.kind == "hang" and hang.ranks == [1]
    assert hang.evidence.culprit_basis == "process_state"
    assert hang.evidence.process_states == {"1": "T"}
    # SIGSTOP also stops the rank's heartbeat thread: no separate unresponsive alert.
    h.sim.silent.add(1)
    h.sim.stall(20.0, lambda r: "comm")
    assert [a.kind for a in h.opened()] == ["hang"]
    h.feed(node_beat(h, {0: "R", 1: "R", 2: "S", 3: "R"}))
    h.sim.silent.clear()
    h.sim.steps(2)
    assert [(a.id, a.status) for a in h.resolved()] == [(hang.id, "resolved")]


def test_d_state_counts_only_when_it_persists() -> None:
    h = harness(ranks=4, dstate_grace=5.0)
    h.sim.steps(20)
    h.feed(node_beat(h, {2: "D"}))
    h.sim.steps(1)
    h.feed(node_beat(h, {2: "S"}))
    h.sim.steps(20)
    assert h.events == []
    h.feed(node_beat(h, {2: "D"}))
    h.sim.stall(6.0, lambda r: "comm" if r != 2 else "data")
    [hang] = h.opened()
    assert hang.ranks == [2] and hang.evidence.process_states == {"2": "D"}


def test_zombie_for_a_whole_timeout_is_a_crash() -> None:
    h = harness(ranks=4, hb_timeout=5.0)
    h.sim.steps(10)
    h.feed(node_beat(h, {3: "Z"}))
    h.sim.silent.add(3)
    h.sim.stall(7.0, lambda r: "comm")
    crashes = h.opened("crash")
    assert [c.ranks for c in crashes] == [[3]]
    assert crashes[0].evidence.source == "node_heartbeat"
    assert not h.opened("unresponsive")


def test_new_attempt_resets_windows_and_late_old_messages_are_ignored() -> None:
    h = harness(ranks=4)
    h.sim.steps(120)
    assert h.job.max_step == 119
    h.sim.attempt = 1
    h.sim.step = 100  # resumed from a checkpoint: steps go backwards
    h.sim.steps(30)
    job = h.job
    assert job.attempt == 1 and job.max_step == 129
    h.feed(StepReport(job=h.sim.cfg.job, time=h.clock, rank=0, step=500, attempt=0))
    assert job.max_step == 129 and job.ranks[0].attempt == 1
    progress = h.detector.progress(h.sim.cfg.job, h.clock)
    assert progress is not None and progress.incarnation == 1 and progress.last_step == 129
    assert progress.min_step is not None and progress.min_step >= 128
    assert h.events == []


def test_hello_sets_world_size_and_per_job_overrides() -> None:
    h = harness(ranks=4)
    hello = RankHello(job=h.sim.cfg.job, rank=0, world_size=4, host="node-0",
                      attempt=Attempt(restart_count=0),
                      env={"TRAINGUARD_HANG_FLOOR": "30", "TRAINGUARD_HB_TIMEOUT": "oops",
                           "TRAINGUARD_NATS_URL": "nats://x:1"})
    h.detector.on_hello(hello, h.clock)
    job = h.job
    assert job.th.hang_floor == 30.0 and job.th.hb_timeout == 5.0
    assert job.world_size == 4 and len(job.rejected_overrides) == 1
    h.sim.steps(50)
    h.sim.stall(20.0, lambda r: "data" if r == 1 else "comm")
    assert h.events == [], "the job's own 30 s floor applies"
    h.sim.stall(15.0, lambda r: "data" if r == 1 else "comm")
    assert [a.ranks for a in h.opened("hang")] == [[1]]


def test_ranks_announced_but_not_yet_beating_are_starting_not_silent() -> None:
    """The agent's hello names its ranks seconds before they import torch and beat."""
    from trainguard.contract.schemas import NodeHello

    h = harness(ranks=4, startup_grace=60.0)
    t0 = h.clock
    h.detector.on_node_hello(NodeHello(job="sim", host="node-0", local_ranks=[0, 1, 2, 3],
                                       time=t0), t0)
    h.tick(t0 + 30.0)
    assert h.events == []
    h.tick(t0 + 61.0)
    [alert] = h.opened()
    assert alert.kind == "unresponsive" and alert.ranks == [0, 1, 2, 3]
