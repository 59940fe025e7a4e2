"""The goodput model's properties: what more failures, faster recoveries and the
checkpoint interval do to ETTR, on seeded histories shared between the compared cases."""

from __future__ import annotations

import statistics

import pytest

from trainguard.analysis.goodput import (
    LLAMA3_DAYS,
    LLAMA3_GPUS,
    LLAMA3_INTERRUPTIONS,
    Category,
    Fault,
    Path,
    Recovery,
    Result,
    System,
    fault_rates,
    simulate,
)
from trainguard.services.checkpointer.interval import IntervalPolicy

WEEK = 7 * 86_400.0
SEEDS = range(6)


def restarting(detect: float = 5.0, recover: float = 60.0) -> System:
    """Every fault restarts the group from the last checkpoint."""
    return System("restart", {f: Path(detect, recover, Recovery.RESTART) for f in Fault})


def young_daly(cost: float, mtbf: float) -> float:
    """The coordinator's rule, unclamped below, so Young/Daly itself is what is tested."""
    return IntervalPolicy(min_seconds=1.0, max_seconds=1e9).period(cost, mtbf)[0]


def run(system: System, seed: int, *, gpus: int = LLAMA3_GPUS, weeks: float = 4.0,
        save_cost: float = 1.0, interval=young_daly, **kw: float) -> Result:
    return simulate(system, gpus=gpus, seconds=weeks * WEEK, save_cost=save_cost,
                    interval=interval, seed=seed, **kw)


def mean_ettr(system: System, **kw) -> float:
    return statistics.fmean(run(system, s, **kw).ettr for s in SEEDS)


def test_the_failure_mix_is_llama3s_419_interruptions() -> None:
    assert sum(c.count for c in LLAMA3_INTERRUPTIONS) == 419
    per_run = sum(fault_rates(LLAMA3_GPUS).values()) * LLAMA3_DAYS * 86_400
    assert per_run == pytest.approx(419)


def test_rates_scale_linearly_with_the_gpu_count() -> None:
    small, large = fault_rates(LLAMA3_GPUS), fault_rates(100_000)
    for fault, rate in small.items():
        assert large[fault] == pytest.approx(rate * 100_000 / LLAMA3_GPUS)


def test_ettr_falls_as_the_mtbf_falls() -> None:
    ettrs = [mean_ettr(restarting(), gpus=g) for g in (4_096, 16_384, 65_536, 262_144)]
    assert ettrs == sorted(ettrs, reverse=True)
    assert ettrs[0] > ettrs[-1] + 0.01


def test_no_failure_leaves_one_minus_the_checkpoint_overhead() -> None:
    quiet = [Category("nothing", 0, Fault.RANK_LOST)]
    every, cost = 100.0, 2.0
    result = simulate(restarting(), gpus=LLAMA3_GPUS, seconds=WEEK, save_cost=cost,
                      interval=lambda c, m: every, seed=0, categories=quiet)
    assert result.failures == 0
    assert result.ettr == pytest.approx(1 - result.spent.checkpoint / WEEK)
    assert result.ettr == pytest.approx(every / (every + cost), abs=(every + cost) / WEEK)
    assert result.spent.rework == result.spent.detection == result.spent.recovery == 0


@pytest.mark.parametrize("faster", [{"recover": 30.0}, {"detect": 0.5}])
def test_a_faster_recovery_never_lowers_ettr(faster: dict[str, float]) -> None:
    slow = restarting(detect=5.0, recover=60.0)
    fast = restarting(**{"detect": 5.0, "recover": 60.0, **faster})
    for seed in SEEDS:  # the same failures at the same times, history by history
        assert run(fast, seed, gpus=100_000).ettr >= run(slow, seed, gpus=100_000).ettr


def test_in_place_beats_a_restart_on_the_same_history() -> None:
    in_place = System("in place", {f: Path(5.0, 60.0, Recovery.IN_PLACE) for f in Fault})
    for seed in SEEDS:
        kept, restarted = run(in_place, seed), run(restarting(), seed)
        assert kept.spent.rework == 0 < restarted.spent.rework
        assert kept.ettr > restarted.ettr


def test_the_young_daly_interval_minimises_the_modelled_loss() -> None:
    """Checkpoint overhead plus rework at the coordinator's interval against half and twice
    it (each 25% worse in Young/Daly's first-order model)."""
    free = restarting(detect=0.0, recover=0.0)

    def loss(scale: float) -> float:
        def rule(cost: float, mtbf: float) -> float:
            return scale * young_daly(cost, mtbf)
        results = [run(free, s, weeks=8.0, interval=rule) for s in SEEDS]
        return statistics.fmean(r.spent.checkpoint + r.spent.rework for r in results)

    best = loss(1.0)
    assert best < loss(0.5)
    assert best < loss(2.0)


def test_the_breakdown_accounts_for_every_second() -> None:
    """Even when failures come during recoveries (long ones at a high rate) and the
    horizon ends inside one."""
    slow = restarting(detect=30.0, recover=900.0)
    for seed in SEEDS:
        r = run(slow, seed, gpus=262_144, weeks=1.0)
        assert r.spent.total == pytest.approx(WEEK)
        assert min(r.spent.detection, r.spent.recovery, r.spent.rework) >= 0


def test_an_undetected_fault_costs_no_time_and_is_counted() -> None:
    blind = System("blind", {f: Path(0.0, 0.0, Recovery.UNDETECTED) for f in Fault})
    quiet = [Category("nothing", 0, Fault.SDC)]
    def every(cost: float, mtbf: float) -> float:
        return 100.0
    r = run(blind, 0, interval=every)
    assert r.undetected == r.failures > 0
    assert r.ettr == pytest.approx(run(blind, 0, interval=every, categories=quiet).ettr)


def test_a_restart_redoes_the_work_since_the_last_checkpoint() -> None:
    """Never more than one interval a failure, half of one on average (failures land
    uniformly within the interval)."""
    every = 600.0
    free = restarting(detect=0.0, recover=0.0)
    results = [run(free, s, interval=lambda c, m: every) for s in SEEDS]
    per_failure = [r.spent.rework / r.failures for r in results]
    assert all(x <= every for x in per_failure)
    assert statistics.fmean(per_failure) == pytest.approx(every / 2, rel=0.15)
