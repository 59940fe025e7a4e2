"""Loss and gradient baselines start over when the job is re-formed or retuned.

A job that shrinks from 8 ranks to 4, resumes from a checkpoint, or gets another learning
rate has another loss curve. Judged against the old baseline its first steps look like a
spike, and the remediator would roll back a healthy job. Each case below moves the loss to
a new level at one step together with a change the Guard reports; the control row makes
the same move with no change reported, and must raise a spike, or the test proves nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from trainguard.contract.schemas import Attempt, RankHello
from trainguard.services.detector.synthetic import Harness, SimConfig
from trainguard.services.detector.thresholds import Thresholds

RANKS = 8


def world_shrinks(h: Harness) -> None:
    h.sim.world_size = RANKS // 2


def lr_changes(h: Harness) -> None:
    h.sim.lr = 1e-4


def new_attempt(h: Harness) -> None:
    h.sim.attempt += 1  # torchrun restarted the group (a restart, resume or rollback)


def rank_restarts(h: Harness) -> None:
    # One rank's new process says hello: it resumed from a checkpoint.
    h.detector.on_hello(RankHello(job="sim", rank=0, world_size=RANKS, host="node-0",
                                  attempt=Attempt(restart_count=h.sim.attempt),
                                  time=h.clock), h.clock)


def nothing(h: Harness) -> None:
    pass


CASES: list[tuple[str, Callable[[Harness], None], bool]] = [
    ("no change reported: a spike", nothing, True),
    ("the world size changed", world_shrinks, False),
    ("the learning rate changed", lr_changes, False),
    ("a new attempt (restart, resume, rollback)", new_attempt, False),
    ("a rank's new process said hello", rank_restarts, False),
]


@pytest.mark.parametrize(("change", "spikes"), [(c, s) for _, c, s in CASES],
                         ids=[name for name, _, _ in CASES])
def test_a_loss_level_change_with_a_reported_change_is_no_spike(
        change: Callable[[Harness], None], spikes: bool) -> None:
    h = Harness(Thresholds(), SimConfig(ranks=RANKS))
    h.sim.world_size = RANKS
    h.sim.lr = 1e-3
    h.sim.steps(120)
    assert h.events == []
    change(h)
    h.sim.loss_level = 2.0
    h.sim.steps(150)
    kinds = [a.kind for a in h.opened()]
    if spikes:
        assert "loss_spike" in kinds
    else:
        assert kinds == [], [a.evidence for a in h.opened()]
        assert h.detector.rules["sim"].numerics.restarts >= 1


def test_after_a_restart_the_new_baseline_judges_again() -> None:
    """The baselines restart, they are not switched off: a real spike after the new
    warm-up is still caught."""
    h = Harness(Thresholds(), SimConfig(ranks=RANKS))
    h.sim.world_size = RANKS
    h.sim.steps(120)
    world_shrinks(h)
    h.sim.loss_level = 2.0
    h.sim.steps(80)
    assert h.events == []
    h.sim.loss_scale[h.sim.step + 5] = 2.0
    h.sim.steps(10)
    [spike] = h.opened()
    assert spike.kind == "loss_spike" and spike.evidence.window < 120


def test_old_clients_that_report_no_world_size_or_lr_keep_one_baseline() -> None:
    h = Harness(Thresholds(), SimConfig(ranks=RANKS))
    h.sim.steps(150)
    assert h.detector.rules["sim"].numerics.restarts == 0
    assert h.events == []
