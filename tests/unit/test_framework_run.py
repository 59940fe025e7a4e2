"""What the framework callbacks share, in one process: steps opened and closed by hooks,
a framework's own checkpoint committed (every file digested, the format named), and
``save_now`` saving at the end of the step it lands in."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch

from tests.unit.test_checkpoint_client import offline_guard, queued_reports
from tests.unit.test_guard_offline import queued
from trainguard.client.hooked import HookedSteps
from trainguard.contract.schemas import Command, StepReport
from trainguard.frameworks import FrameworkRun
from trainguard.services.checkpointer.verify import verify_checkpoint


def test_a_hooked_step_reports_its_phases_loss_and_grad_norm_once() -> None:
    guard = offline_guard()
    steps = HookedSteps(guard)
    steps.begin(0)
    steps.phase("optimizer")
    steps.report(loss=torch.tensor(1.5), grad_norm=2.0)
    assert steps.current is not None and steps.end() is True
    assert steps.end() is False  # nothing open: a second end is nothing
    steps.begin(1)
    steps.begin(2)  # the framework skipped an end hook: step 1 is ended first
    steps.fail(RuntimeError("boom"))
    guard.close(timeout=0.1)
    reports = queued(guard, StepReport)
    assert [r.step for r in reports] == [0, 1]  # a failed step is not reported as done
    assert reports[0].loss == 1.5 and reports[0].grad_norm == 2.0
    assert set(reports[0].phases) == {"compute", "optimizer"}
    assert guard.last_completed_step == 1


def framework_checkpoint(path: Path) -> dict[str, bytes]:
    files = {"model.safetensors": b"weights" * 100, "trainer_state.json": b"{}"}
    path.mkdir(parents=True)
    for name, data in files.items():
        (path / name).write_bytes(data)
    return files


def test_a_frameworks_checkpoint_is_committed_with_every_file(tmp_path: Path) -> None:
    run = FrameworkRun(offline_guard(), job=None, root=tmp_path, format="hf")
    ckpt = run.start(torch.nn.Linear(2, 2), None)
    path = run.job_dir / "checkpoint-8"
    files = framework_checkpoint(path)
    run.saved(7, path)
    report = ckpt.wait()
    assert report is not None and report.ok and report.format == "hf", report
    assert report.step == 7 and report.path == str(path)
    assert set(report.files) == {*files, "run.json"}
    for name, data in files.items():
        assert report.files[name].crc32 == zlib.crc32(data)
    # The coordinator's verdict: no DCP .metadata is asked of a framework's format.
    assert verify_checkpoint({0: report}, 1, mode="full").ok
    (path / "model.safetensors").write_bytes(b"torn")
    assert not verify_checkpoint({0: report}, 1, mode="full").ok
    run.close()


@pytest.mark.parametrize("layout", ["empty", "nested"])
def test_a_checkpoint_that_cannot_be_verified_is_reported_failed(tmp_path: Path,
                                                                 layout: str) -> None:
    run = FrameworkRun(offline_guard(), job=None, root=tmp_path, format="lightning")
    ckpt = run.start(torch.nn.Linear(2, 2), None)
    path = run.job_dir / "step-3"
    path.mkdir(parents=True)
    if layout == "nested":
        (path / "shards").mkdir()
    run.saved(3, path)
    report = ckpt.wait()
    assert report is not None and not report.ok
    assert ("no files" if layout == "empty" else "holds directories") in report.error
    run.close()


def test_save_now_saves_at_the_end_of_the_step_it_lands_in(tmp_path: Path) -> None:
    run = FrameworkRun(offline_guard(), job=None, root=tmp_path, format="lightning",
                       checkpoint_every=100)
    ckpt = run.start(torch.nn.Linear(2, 2), None)
    steps = run.steps
    for n in range(3):
        steps.begin(n)
        steps.end()
    assert not run.save_due(2)
    steps.begin(3)  # a save_now at the entry of step 3: step 3 is what gets saved
    handler = run.guard.commands.handlers["save_now"]
    detail = handler(Command(id="c1", job=run.guard.job, kind="save_now", issuer="coordinator"))
    assert detail == "step=3 saving"
    assert run.save_due(3)
    steps.end()
    run.saved(3, framework_checkpoint_dir(run, 3))
    assert ckpt.wait() is not None
    assert not run.save_due(4)  # answered once
    assert [r.step for r in queued_reports(run.guard)] == [3]
    again = handler(Command(id="c2", job=run.guard.job, kind="save_now", issuer="coordinator",
                            at_step=3))
    assert again == "step=3 already saved"
    run.close()


def framework_checkpoint_dir(run: FrameworkRun, step: int) -> Path:
    path = run.job_dir / f"step-{step}"
    framework_checkpoint(path)
    return path
