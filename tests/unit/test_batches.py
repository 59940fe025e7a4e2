"""Batch checks: what a rank finds wrong with its batch, the skipped step, and how the
detector and the diagnoser read it."""

from __future__ import annotations

import math

import pytest
import torch

from trainguard.client import Guard, SkipStep
from trainguard.contract.errors import ConfigError
from trainguard.contract.evidence import BadBatchEvidence, BatchFault
from trainguard.contract.schemas import Anomaly, StepReport
from trainguard.services.detector.synthetic import Harness, SimConfig
from trainguard.services.detector.thresholds import Thresholds
from trainguard.services.diagnoser.rules import Diagnoser
from trainguard.torch import BatchCheck, check_batch


def test_a_good_batch_passes_and_its_layout_is_remembered() -> None:
    ref: dict[str, tuple[torch.dtype, int]] = {}
    batch = {"input_ids": torch.randint(0, 100, (4, 16)), "x": torch.randn(4, 8)}
    assert check_batch(batch, reference=ref, max_abs=10.0,
                       bounds={"input_ids": (0, 99)}) is None
    assert ref == {"input_ids": (torch.int64, 2), "x": (torch.float32, 2)}
    short = {"input_ids": torch.randint(0, 100, (2, 9)), "x": torch.randn(2, 8)}
    assert check_batch(short, reference=ref) is None, "a short last batch is no fault"


def test_nan_names_the_key_the_row_and_the_sample_id() -> None:
    x = torch.randn(4, 8)
    x[2, 5] = float("nan")
    fault = check_batch({"input_ids": torch.zeros(4, 3, dtype=torch.long), "x": x},
                        ids=[10, 11, 12, 13], source="shard-0007")
    assert fault is not None
    assert (fault.kind, fault.key, fault.sample, fault.sample_id, fault.source) == \
        ("nonfinite", "x", 2, "12", "shard-0007")
    assert "1 of 32" in fault.detail


def test_inf_in_a_nested_list_is_found() -> None:
    y = torch.ones(3)
    y[0] = float("inf")
    fault = check_batch((torch.ones(2), [y]))
    assert fault is not None and fault.kind == "nonfinite" and fault.key == "[1][0]"


def test_a_sum_that_overflows_is_no_fault() -> None:
    big = torch.full((4, 4), 3e38)
    assert not math.isfinite(float(big.sum()))
    assert check_batch(big) is None


@pytest.mark.parametrize(("batch", "kind"), [
    (None, "none"),
    ({}, "empty"),
    ([], "empty"),
    (torch.empty(0, 4), "empty"),
])
def test_nothing_to_train_on(batch: object, kind: str) -> None:
    fault = check_batch(batch)
    assert fault is not None and fault.kind == kind


def test_bounds_and_magnitude() -> None:
    ids = torch.tensor([[1, 2], [3, 120]])
    fault = check_batch({"input_ids": ids}, bounds={"input_ids": (0, 99)})
    assert fault is not None and fault.kind == "out_of_bounds" and fault.sample == 1
    assert check_batch({"x": torch.tensor([[1.0], [-5e7]])}, max_abs=1e6) is not None
    assert check_batch({"x": torch.tensor([[1.0], [-5e7]])}) is None, "no bound: no check"
    assert check_batch({"x": torch.tensor([7.0])}, bounds={"*": (0.0, 1.0)}) is not None


def test_dtype_and_rank_changes_against_the_first_batch() -> None:
    ref: dict[str, tuple[torch.dtype, int]] = {}
    assert check_batch({"x": torch.randn(4, 8)}, reference=ref) is None
    f1 = check_batch({"x": torch.randn(4, 8).double()}, reference=ref)
    f2 = check_batch({"x": torch.randn(4, 8, 1)}, reference=ref)
    assert f1 is not None and f1.kind == "dtype"
    assert f2 is not None and f2.kind == "shape"


class _Step:
    def __init__(self, n: int) -> None:
        self.n = n
        self.batch_fault: BatchFault | None = None


def test_the_check_runs_on_its_steps_only_and_raises_skip() -> None:
    guard = Guard(job="j", rank=0, world_size=1, enabled=False)
    check = BatchCheck(guard, every=2)
    bad = torch.tensor([float("nan")])
    s1 = _Step(1)
    assert check(s1, bad) is bad and s1.batch_fault is None, "step 1 is not checked"
    s2 = _Step(2)
    with pytest.raises(SkipStep):
        check(s2, bad)
    assert s2.batch_fault is not None and check.skipped == [2]
    report_only = BatchCheck(guard, skip=False)
    s3 = _Step(3)
    assert report_only(s3, bad) is bad and s3.batch_fault is not None


def test_settings_come_from_the_environment_and_bad_ones_name_the_key(
        monkeypatch: pytest.MonkeyPatch) -> None:
    guard = Guard(job="j", rank=0, world_size=1, enabled=False)
    monkeypatch.setenv("TRAINGUARD_BATCH_CHECK_EVERY", "5")
    monkeypatch.setenv("TRAINGUARD_BAD_BATCH", "report")
    check = BatchCheck(guard)
    assert (check.every, check.skip) == (5, False)
    monkeypatch.setenv("TRAINGUARD_BAD_BATCH", "drop")
    with pytest.raises(ConfigError, match="TRAINGUARD_BAD_BATCH"):
        BatchCheck(guard)
    monkeypatch.setenv("TRAINGUARD_BATCH_CHECK_EVERY", "often")
    with pytest.raises(ConfigError, match="TRAINGUARD_BATCH_CHECK_EVERY"):
        BatchCheck(guard, skip=True)


def test_a_skipped_step_counts_as_done_and_reports_its_fault() -> None:
    sent: list[StepReport] = []
    guard = Guard(job="j", rank=0, world_size=1, enabled=True, heartbeat_interval=60)
    guard.reports.publish_step = sent.append
    guard.start = lambda: guard  # type: ignore[method-assign]  # no bus: reports only
    guard._started = True
    check = BatchCheck(guard)
    updated: list[int] = []
    done: list[int] = []
    for step in range(3):
        with guard.step(step) as s:
            batch = check(s, torch.tensor([float("nan")]) if step == 1 else torch.ones(1))
            s.report(loss=float(batch.sum()))
            updated.append(step)
        if s.done:
            done.append(step)
    assert updated == [0, 2], "the skipped step's update never ran"
    assert done == [0, 2], "the loop is told which steps ran to their end"
    assert guard.last_completed_step == 2
    by_step = {r.step: r for r in sent}
    assert by_step[1].skipped and by_step[1].loss is None
    assert by_step[1].batch_fault is not None and by_step[1].batch_fault.kind == "nonfinite"
    assert not by_step[2].skipped and by_step[2].batch_fault is None


def _harness() -> Harness:
    return Harness(Thresholds(), SimConfig(ranks=4))


def test_detector_raises_bad_batch_for_a_skipped_step_not_nonfinite() -> None:
    h = _harness()
    h.sim.steps(20)
    h.sim.bad_batches[23] = {2: BatchFault(kind="nonfinite", key="x", sample=5)}
    h.sim.steps(5)
    [bad] = h.opened()
    assert bad.kind == "bad_batch" and bad.step == 23 and bad.ranks == [2]
    assert isinstance(bad.evidence, BadBatchEvidence) and bad.evidence.skipped
    assert bad.evidence.faults["2"].sample == 5 and bad.severity == "warning"
    h.sim.steps(25)
    assert [a.id for a in h.resolved()] == [bad.id]


def test_a_bad_batch_let_through_is_named_in_the_nonfinite_evidence() -> None:
    h = _harness()
    h.sim.skip_bad_batches = False
    h.sim.steps(20)
    h.sim.bad_batches[23] = {1: BatchFault(kind="nonfinite", key="x")}
    h.sim.nan_ranks[23] = {0, 1, 2, 3}
    h.sim.steps(5)
    kinds = {a.kind: a for a in h.opened()}
    assert set(kinds) == {"bad_batch", "nonfinite"}
    assert kinds["bad_batch"].severity == "critical"
    assert kinds["nonfinite"].evidence.bad_batch_ranks == [1]


def _anomaly(evidence: object, kind: str) -> Anomaly:
    return Anomaly(id="a1", job="j", kind=kind, ranks=[2], hosts=["node-b"], step=23,
                   onset_at=100.0, detected_at=100.5, evidence=evidence)


def test_diagnoser_names_the_data_pipeline_and_the_sample() -> None:
    ev = BadBatchEvidence(faults={"2": BatchFault(kind="nonfinite", key="x", sample=5,
                                                  sample_id="s-9", source="shard-7",
                                                  detail="1 of 32 values NaN/Inf")},
                          skipped=True)
    (d,) = Diagnoser().on_anomaly(_anomaly(ev, "bad_batch"), 101.0).publish
    assert d.cause == "data_pipeline" and d.ranks == [2] and d.recommended[0] == "alert"
    text = " ".join(e.fact for e in d.evidence)
    assert "sample s-9" in text and "shard-7" in text and "not updated" in text
