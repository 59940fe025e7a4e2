"""Straggler, data stall, throughput drop and slow checkpoint rules on synthetic streams."""

from __future__ import annotations

from trainguard.contract.schemas import CheckpointReport, StepReport, TelemetryMessage
from trainguard.services.detector.synthetic import Harness, SimConfig
from trainguard.services.detector.thresholds import Thresholds


def harness(ranks: int = 16, th: Thresholds | None = None, **cfg: object) -> Harness:
    return Harness(th or Thresholds(), SimConfig(ranks=ranks, **cfg))  # type: ignore[arg-type]


def test_straggler_hidden_in_total_step_time_is_found_from_compute_time() -> None:
    h = harness(ranks=16)
    h.sim.steps(100)
    seen: list[StepReport] = []
    feed = h.sim.sink

    def spy(msg: TelemetryMessage) -> None:
        if isinstance(msg, StepReport):
            seen.append(msg)
        feed(msg)

    h.sim.sink = spy
    h.sim.slow[5] = 1.5
    onset = h.sim.step
    h.sim.steps(12)
    # Synchronous training: every rank reports the same total step time...
    by_step: dict[int, set[float]] = {}
    for r in seen:
        by_step.setdefault(r.step, set()).add(r.duration)
    assert all(len(d) == 1 for d in by_step.values())
    # ...and still the slow rank, and only it, is named within the patience.
    [alert] = h.opened()
    assert alert.kind == "straggler" and alert.ranks == [5] and alert.hosts == ["node-0"]
    assert alert.step is not None and alert.step - onset <= 8
    ev = alert.evidence
    assert 1.35 < ev.ratio < 1.65 and ev.z > 3.5 and ev.flagged_steps >= 8
    assert h.job.ranks[5].straggling
    progress = h.detector.progress("sim", h.clock)
    assert progress is not None and progress.ranks[5].state == "slow"
    h.sim.slow.clear()
    h.sim.steps(12)
    [resolved] = h.resolved()
    assert resolved.id == alert.id and resolved.rev == 2


def test_ordinary_jitter_and_single_slow_steps_are_not_stragglers() -> None:
    h = harness(ranks=16, jitter=0.15, slow_step_prob=0.01, seed=7)
    h.sim.steps(1500)
    # A rank that is 3x slow on every fifth step only: 2 of 10, never 8 of 10.
    for _ in range(10):
        h.sim.slow[3] = 3.0
        h.sim.steps(1)
        h.sim.slow.clear()
        h.sim.steps(4)
    assert h.events == []


def test_straggler_needs_a_few_ranks_to_have_a_median() -> None:
    h = harness(ranks=2)
    h.sim.slow[1] = 2.0
    h.sim.steps(50)
    assert h.opened("straggler") == []


def test_four_rank_job_finds_a_rank_slowed_2x() -> None:
    """The demo's drill: 2 hosts x 2 ranks, one rank slowed 2x."""
    h = harness(ranks=4, ranks_per_host=2)
    h.sim.steps(30)
    h.sim.slow[3] = 2.0
    h.sim.steps(10)
    [alert] = h.opened()
    assert alert.ranks == [3] and alert.hosts == ["node-1"]


def test_data_stall_names_the_rank_waiting_for_data() -> None:
    h = harness(ranks=8)
    h.sim.steps(60)
    h.sim.data_extra[4] = 1.5
    h.sim.steps(5)
    [stall] = h.opened()
    assert stall.kind == "data_stall" and stall.ranks == [4]
    assert stall.evidence.stalled_steps == 3 and stall.evidence.threshold == 1.0
    h.sim.data_extra.clear()
    h.sim.steps(12)
    assert [a.id for a in h.resolved()] == [stall.id]


def test_throughput_drop_against_the_jobs_own_baseline() -> None:
    h = harness(ranks=8)
    h.sim.steps(120)
    h.sim.step_time_scale = 1.8
    onset = h.sim.step
    h.sim.steps(25)
    drops = h.opened("throughput_drop")
    assert len(drops) == 1 and drops[0].step is not None and drops[0].step - onset <= 12
    assert drops[0].evidence.ratio < 0.7
    assert h.opened("straggler") == [], "every rank slowed alike: no straggler"
    h.sim.steps(100)
    assert h.resolved() == [], "a lasting drop stays open: the baseline does not learn it"
    h.sim.step_time_scale = 1.0
    h.sim.steps(25)
    assert [a.kind for a in h.resolved()] == ["throughput_drop"]


def test_no_throughput_judgement_before_a_baseline_exists() -> None:
    h = harness(ranks=4)
    h.sim.steps(30)
    h.sim.step_time_scale = 3.0
    h.sim.steps(30)
    assert h.opened("throughput_drop") == []


def report(step: int, rank: int, seconds: float) -> CheckpointReport:
    return CheckpointReport(id=f"c{step}-{rank}", job="sim", rank=rank, step=step,
                            path=f"/ckpt/sim/step-{step}", world_size=2,
                            seconds_total=seconds, time=1_700_000_000.0 + step)


def test_slow_checkpoint_from_shard_reports_and_its_resolution() -> None:
    h = harness(ranks=2)
    d = h.detector
    for step, seconds in ((100, 12.0), (200, 11.0), (300, 13.0)):
        for rank in (0, 1):
            d.on_checkpoint(report(step, rank, seconds), h.clock)
    assert h.collect() == []
    d.on_checkpoint(report(400, 0, 12.5), h.clock)
    d.on_checkpoint(report(400, 1, 41.0), h.clock)
    [slow] = h.collect()
    assert slow.kind == "checkpoint_slow" and slow.ranks == [1] and slow.step == 400
    assert slow.evidence.source == "report" and slow.evidence.usual == 12.0
    d.on_checkpoint(report(500, 0, 12.0), h.clock)
    [resolved] = h.collect()
    assert resolved.id == slow.id and resolved.status == "resolved"


def test_slow_checkpoint_seen_in_step_phases_after_it_finished() -> None:
    cfg = SimConfig(ranks=4, checkpoint_every=50, checkpoint_seconds=(10.0, 10.5))
    h = Harness(Thresholds(), cfg)
    h.sim.steps(151)
    assert h.events == []
    h.sim.cfg.checkpoint_seconds = (26.0, 26.0)
    h.sim.steps(50)
    kinds = {a.kind for a in h.opened()}
    assert "checkpoint_slow" in kinds and "hang" not in kinds
    h.sim.cfg.checkpoint_seconds = (10.0, 10.5)
    h.sim.steps(55)
    assert "checkpoint_slow" in {a.kind for a in h.resolved()}
