"""Young/Daly interval policy: T = sqrt(2 C MTBF), clamped, in steps, published on change."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainguard.services.checkpointer.interval import IntervalPolicy

POLICY = IntervalPolicy(min_seconds=60, max_seconds=3600, mtbf_prior=86400, change_fraction=0.2)


def test_young_daly_from_cost_and_prior() -> None:
    d = POLICY.decide(blocked=[2.0, 2.0, 2.0], failures=0, observed=0.0, step_time=0.5,
                      current_steps=None)
    assert d is not None
    assert d.raw_seconds == pytest.approx(math.sqrt(2 * 2.0 * 86400))  # ~588 s
    assert d.seconds == pytest.approx(d.raw_seconds)
    assert d.every_steps == round(d.seconds / 0.5)
    assert d.publish


def test_cost_is_the_median_of_recent_saves() -> None:
    d = POLICY.decide(blocked=[1.0, 50.0, 1.0, 1.2, 0.9], failures=0, observed=0.0,
                      step_time=1.0, current_steps=None)
    assert d is not None and d.cost == 1.0


def test_clamped_to_the_bounds() -> None:
    tiny = POLICY.decide(blocked=[0.001], failures=0, observed=0.0, step_time=0.1,
                         current_steps=None)
    huge = POLICY.decide(blocked=[600.0], failures=0, observed=0.0, step_time=0.1,
                         current_steps=None)
    assert tiny is not None and tiny.seconds == 60 and tiny.raw_seconds < 60
    assert huge is not None and huge.seconds == 3600 and huge.raw_seconds > 3600
    assert (tiny.every_steps, huge.every_steps) == (600, 36000)


def test_failures_shorten_and_failure_free_time_lengthens() -> None:
    base = POLICY.mtbf(0, 0.0)
    assert base == 86400
    assert POLICY.mtbf(3, 3600.0) == pytest.approx((86400 + 3600) / 4)
    assert POLICY.mtbf(0, 86400.0) == 2 * base
    periods = [POLICY.period(5.0, POLICY.mtbf(f, 7200.0))[0] for f in range(5)]
    assert periods == sorted(periods, reverse=True)


def test_publishes_only_when_the_interval_moves_by_more_than_the_fraction() -> None:
    d = POLICY.decide(blocked=[2.0], failures=0, observed=0.0, step_time=1.0, current_steps=None)
    assert d is not None
    same = POLICY.decide(blocked=[2.0], failures=0, observed=0.0, step_time=1.0,
                         current_steps=round(d.every_steps * 1.1))
    moved = POLICY.decide(blocked=[2.0], failures=0, observed=0.0, step_time=1.0,
                          current_steps=round(d.every_steps * 1.5))
    assert same is not None and not same.publish
    assert moved is not None and moved.publish


def test_nothing_to_decide_without_a_measurement_or_a_step_time() -> None:
    assert POLICY.decide(blocked=[], failures=0, observed=0.0, step_time=1.0,
                         current_steps=None) is None
    assert POLICY.decide(blocked=[1.0], failures=0, observed=0.0, step_time=0.0,
                         current_steps=None) is None


@given(cost=st.floats(0.0, 1e4), failures=st.integers(0, 1000),
       observed=st.floats(0.0, 1e8), step_time=st.floats(1e-3, 100.0))
def test_interval_always_within_bounds(cost: float, failures: int, observed: float,
                                       step_time: float) -> None:
    d = POLICY.decide(blocked=[cost], failures=failures, observed=observed,
                      step_time=step_time, current_steps=None)
    assert d is not None
    assert 60 <= d.seconds <= 3600
    assert d.every_steps >= 1
    # The step count is the period rounded to whole steps.
    assert abs(d.every_steps * step_time - d.seconds) <= step_time / 2 + 1e-6 \
        or d.every_steps == 1
