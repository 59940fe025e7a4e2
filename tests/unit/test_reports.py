"""Report assembly without a transport: aggregation, values still on the device, NaN drill."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pytest

from trainguard.client.reports import PENDING_LIMIT, Pending, Reports, aggregate
from trainguard.contract.schemas import Fingerprint, StepReport

INF = math.inf


@dataclass
class Finished:
    n: int
    loss: Any = None
    grad_norm: Any = None
    tokens: int | None = None
    samples: int | None = None
    extra: dict[str, Any] | None = None
    lr: float | None = None
    phases: dict[str, float] = field(default_factory=dict)
    batch_fault: Any = None
    skipped: bool = False


@dataclass
class OnDevice:
    """A value the device has not finished computing until ``done`` is set."""

    v: float
    done: bool = False

    def ready(self) -> bool:
        return self.done

    def value(self) -> float:
        return self.v


def make(**kw: Any) -> tuple[Reports, list[StepReport], list[Fingerprint]]:
    steps: list[StepReport] = []
    fps: list[Fingerprint] = []
    kw.setdefault("report_every", 1)
    kw.setdefault("fingerprint_every", 0)
    reports = Reports("j", 3, 2, model=lambda: None, publish_step=steps.append,
                      publish_fingerprint=fps.append, **kw)
    return reports, steps, fps


def report(step: int, duration: float = 1.0, **kw: Any) -> StepReport:
    return StepReport(job="j", time=0.0, rank=0, step=step, duration=duration, **kw)


@pytest.mark.parametrize(("reports", "expected"), [
    pytest.param([report(1, 1.0, phases={"compute": 1.0}, grad_norm=1.0, tokens=5),
                  report(2, 3.0, phases={"compute": 3.0, "data": 2.0}, grad_norm=3.0,
                         tokens=7)],
                 (2, 2.0, {"compute": 2.0, "data": 1.0}, 3.0, 0, 12, None, 2), id="means"),
    pytest.param([report(1, grad_norm=1.0), report(2, grad_norm=INF, nonfinite=1),
                  report(3, grad_norm=3.0)],
                 (3, 1.0, {}, INF, 1, None, None, 3), id="a non-finite norm wins"),
    pytest.param([report(1, samples=4), report(2)],
                 (2, 1.0, {}, None, 0, None, 4, 2), id="no norms"),
])
def test_aggregate(reports: list[StepReport], expected: tuple[Any, ...]) -> None:
    out = aggregate(reports)
    assert (out.step, out.duration, out.phases, out.grad_norm, out.nonfinite, out.tokens,
            out.samples, out.steps) == expected


def test_each_step_is_reported_with_identity_sequence_and_extras() -> None:
    reports, steps, _ = make()
    reports.record(Finished(7, loss=2.0, grad_norm=0.5, extra={"lr": 0.1},
                            phases={"compute": 0.2}), 0.25)
    reports.record(Finished(8, loss=1.0), 0.25)
    first, second = steps
    assert (first.job, first.rank, first.attempt, first.step, first.seq) == ("j", 3, 2, 7, 1)
    assert first.loss == 2.0 and first.extra == {"lr": 0.1} and first.duration == 0.25
    assert second.seq == 2 and second.nonfinite == 0


def test_the_steps_own_learning_rate_wins_over_the_optimizers() -> None:
    reports, steps, _ = make(lr=lambda: 0.5, world_size=4)
    reports.record(Finished(0, loss=1.0, lr=0.25), 0.1)
    reports.record(Finished(1, loss=1.0), 0.1)
    assert [(s.lr, s.world_size) for s in steps] == [(0.25, 4), (0.5, 4)]


def test_the_nan_drill_needs_a_loss_to_replace() -> None:
    reports, steps, _ = make()
    assert reports.record(Finished(0), 0.1, nan_loss=True) is False
    assert reports.record(Finished(1, loss=1.0), 0.1, nan_loss=True) is True
    assert steps[0].loss is None and math.isnan(steps[1].loss) and steps[1].nonfinite == 1


def test_non_finite_values_skip_the_aggregation() -> None:
    reports, steps, _ = make(report_every=4)
    for i in range(3):
        reports.record(Finished(i, loss=1.0), 0.1)
    assert steps == []
    reports.record(Finished(3, loss=INF), 0.1)
    assert [(r.step, r.steps, r.nonfinite) for r in steps] == [(3, 4, 1)]
    reports.record(Finished(4, loss=1.0), 0.1)
    reports.flush()
    assert [(r.step, r.steps) for r in steps[1:]] == [(4, 1)]


def test_values_on_the_device_wait_without_blocking_then_go_out_in_order() -> None:
    reports, steps, fps = make()
    slow, fast = OnDevice(4.0), OnDevice(0.5, done=True)
    reports.pending.append(Pending(report(1), {"loss": slow, "extra.lr": fast}))
    reports.pending.append(Pending(Fingerprint(job="j", time=0.0, rank=0, step=1, checksum=0),
                                   {"checksum": OnDevice(42.0, done=True)}))
    reports.pending.append(Pending(Fingerprint(job="j", time=0.0, rank=0, step=0, checksum=0),
                                   {"checksum": OnDevice(7.0, done=True)}))
    reports.poll(force=False)
    # Step 0's fingerprint goes; step 1's waits behind its report (it may say non-finite).
    assert steps == [] and [f.checksum for f in fps] == [7] and len(reports.pending) == 2
    slow.done = True
    reports.poll(force=False)
    assert [(r.loss, r.extra) for r in steps] == [(4.0, {"lr": 0.5})]
    assert [f.checksum for f in fps] == [7, 42] and reports.pending == []


def test_a_step_that_went_non_finite_sends_no_fingerprint() -> None:
    """Replicas that all went NaN hold NaNs of different bit patterns (one written, others
    computed): their checksums disagree, though no rank's hardware did anything wrong."""
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(2, 2)
    reports, steps, fps = make(fingerprint_every=1)
    reports.model = lambda: model
    reports.record(Finished(0, loss=1.0), 0.1)
    reports.record(Finished(1, loss=1.0), 0.1, nan_loss=True)
    reports.record(Finished(2, grad_norm=INF), 0.1)
    reports.record(Finished(3, loss=1.0), 0.1)
    # On the device: the report and the fingerprint wait, and go out in order.
    loss = OnDevice(math.nan)
    reports.pending.append(Pending(report(4), {"loss": loss}))
    reports.pending.append(Pending(Fingerprint(job="j", time=0.0, rank=0, step=4, checksum=0),
                                   {"checksum": OnDevice(1.0, done=True)}))
    reports.poll(force=False)
    loss.done = True
    reports.poll(force=False)
    assert [s.nonfinite for s in steps] == [0, 1, 1, 0, 1]
    assert [f.step for f in fps] == [0, 3]


def test_close_reads_everything_and_a_device_far_behind_keeps_only_the_newest() -> None:
    reports, steps, _ = make()
    for i in range(PENDING_LIMIT + 10):
        reports.pending.append(Pending(report(i), {"loss": OnDevice(float(i))}))
    reports.poll(force=False)
    assert len(reports.pending) == PENDING_LIMIT and reports.pending[0].message.step == 10
    reports.poll(force=True)
    assert [r.step for r in steps] == list(range(10, PENDING_LIMIT + 10))


def test_report_every_must_be_positive() -> None:
    with pytest.raises(ValueError, match="report_every=0"):
        make(report_every=0)
