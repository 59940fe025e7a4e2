"""``trainguard.hf.Trainguard``'s own logic, driven through the Trainer's hooks in the
Trainer's order with a Guard that has no bus: saves asked for at the interval, the step
kept open for the loss HF logs, HF's checkpoint committed as ``step-<S>``, and an
``output_dir`` outside ``<root>/<job>`` refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import TrainerControl, TrainerState, TrainingArguments

from trainguard.client import Guard
from trainguard.contract.errors import ConfigError
from trainguard.hf import Trainguard


def callback(root: Path, every: int | None = 3) -> Trainguard:
    guard = Guard(job="hfjob", rank=0, world_size=1, enabled=False, checkpoint_every=every)
    return Trainguard(root=root, guard=guard)


def arguments(out: Path, **kw: object) -> TrainingArguments:
    return TrainingArguments(output_dir=str(out), use_cpu=True, report_to=[],
                             save_strategy="no", **kw)  # type: ignore[arg-type]


def step(cb: Trainguard, args: TrainingArguments, state: TrainerState,
         control: TrainerControl, *, log: bool = False, loss: float = 1.0) -> None:
    """One optimizer step as the Trainer runs its hooks (DefaultFlowCallback first)."""
    control.should_log = control.should_save = False
    cb.on_step_begin(args, state, control)
    cb.on_pre_optimizer_step(args, state, control, model=None)
    state.global_step += 1
    control.should_log = log
    cb.on_step_end(args, state, control)
    if log:
        cb.on_log(args, state, control, logs={"loss": loss, "grad_norm": 2.0})


def test_saves_are_asked_for_at_the_interval_and_on_save_now(tmp_path: Path) -> None:
    cb = callback(tmp_path)
    args, state, control = arguments(tmp_path / "hfjob"), TrainerState(), TrainerControl()
    cb.on_init_end(args, state, control)
    asked = []
    for _ in range(7):
        step(cb, args, state, control)
        if control.should_save:
            asked.append(state.global_step - 1)
    assert asked == [2, 5]  # guard steps 2 and 5: HF's checkpoint-3 and checkpoint-6
    cb.run._save_now(7)  # what the Guard runs for a save_now command
    step(cb, args, state, control)
    assert control.should_save


def test_a_logged_step_stays_open_until_its_loss_arrives(tmp_path: Path) -> None:
    cb = callback(tmp_path, every=1)
    args, state, control = arguments(tmp_path / "hfjob"), TrainerState(), TrainerControl()
    cb.on_step_begin(args, state, control)
    state.global_step += 1
    control.should_log = True
    cb.on_step_end(args, state, control)
    open_step = cb.run.steps.current
    assert open_step is not None and not control.should_save  # not yet: HF logs first
    cb.on_log(args, state, control, logs={"loss": 2.5, "grad_norm": 4.0})
    assert cb.run.steps.current is None and open_step.done and control.should_save
    assert open_step.loss is None  # a step that ended holds none of the trainer's values
    # HF's logs of a step it did not say it would log (evaluation, the run's end) are not
    # taken for a step's loss.
    assert cb.on_log(args, state, control, logs={"train_loss": 1.0}) is control


def test_the_trainers_checkpoint_is_committed_as_step_s(tmp_path: Path) -> None:
    job_dir = tmp_path / "hfjob"
    cb = callback(tmp_path)
    args, state, control = arguments(job_dir), TrainerState(), TrainerControl()
    model = torch.nn.Linear(2, 2)
    cb.on_train_begin(args, state, control, model=model,
                      optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    state.global_step = 3
    written = job_dir / "checkpoint-3"
    written.mkdir(parents=True)
    (written / "trainer_state.json").write_text("{}")
    control.should_save = True
    cb.on_save(args, state, control)
    assert not control.should_save  # an epoch's end right after does not save it again
    assert not written.exists() and (job_dir / "step-2" / "trainer_state.json").exists()
    ckpt = cb.run.checkpointer
    assert ckpt is not None
    report = ckpt.wait()
    assert report is not None and report.ok and report.step == 2 and report.format == "hf"
    assert report.path == str(job_dir / "step-2") and "trainer_state.json" in report.files
    cb.on_train_end(args, state, control)


def test_an_output_dir_outside_root_job_is_refused_naming_the_fix(tmp_path: Path) -> None:
    cb = callback(tmp_path)
    with pytest.raises(ConfigError, match=r"output_dir=.*set output_dir=.*hfjob"):
        cb.on_init_end(arguments(tmp_path / "elsewhere"), TrainerState(), TrainerControl())
