"""``trainguard.hf.Trainguard``: a callback for the Hugging Face ``transformers.Trainer``.

.. code-block:: python

    guard = trainguard.hf.Trainguard(job="llama-8b", root="/ckpt")
    args = TrainingArguments(output_dir="/ckpt/llama-8b", save_strategy="no", ...)
    trainer = Trainer(model, args, train_dataset=data, callbacks=[guard])
    trainer.train(resume_from_checkpoint=guard.resume_path())

It reports each optimizer step (phases ``compute`` and ``optimizer``, gradient norm, the
loss HF logs), makes the Trainer save at the interval the coordinator sets and on
``save_now``, reports each checkpoint the Trainer writes for commit, and ``resume_path()``
names the newest committed one, so a restarted group goes on from it. The Trainer owns its
process group: a lost rank restarts the group (docs/hf.md).

Layout: ``TrainingArguments.output_dir`` must be ``<root>/<job>``. The Trainer writes
``checkpoint-<global_step>`` there; once every rank's part is on disk, group rank 0 renames
it ``step-<S>`` (S = global_step - 1, the guard's number of the step just completed, as
the Lightning callback and the Checkpointer number it), the layout the coordinator commits,
retains and points ``LATEST`` at.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from trainguard.client import Guard
from trainguard.contract.errors import ConfigError
from trainguard.frameworks import FrameworkRun

HF_PREFIX = "checkpoint"
"""The Trainer's name for a checkpoint directory (``transformers.trainer_utils``)."""


class Trainguard(TrainerCallback):
    """The Trainer callback (one per trainer).

    Args:
        job: the job's name (default: ``TRAINGUARD_JOB``).
        root: the checkpoint root, shared by every host; the Trainer's ``output_dir`` must
            be ``<root>/<job>``.
        guard: a Guard of your own, instead of one made here.
        grad_norm: report each step's total gradient norm. Without clipping
            (``max_grad_norm=0``) a fused norm over the gradients before the optimizer step,
            every step, no host sync; with clipping (HF's default) the Trainer has already
            clipped the gradients by then, so the pre-clip norm HF logs is reported instead,
            at logging steps.
        checkpoint_every: save every this many steps until the coordinator sets the
            interval (None: only when it does, or on ``save_now``).
    """

    def __init__(self, job: str | None = None, root: str | os.PathLike[str] = "checkpoints",
                 *, guard: Guard | None = None, grad_norm: bool = True,
                 checkpoint_every: int | None = None) -> None:
        self.run = FrameworkRun(guard, job=job, root=root, format="hf",
                                grad_norm=grad_norm, checkpoint_every=checkpoint_every)
        self.guard = self.run.guard
        self._resumed: str | None = None
        self._clipping = False
        self._awaiting_log = False
        """The step ended but HF logs it next: it stays open until ``on_log`` brings its loss."""

    def resume_path(self) -> str | None:
        """The newest committed checkpoint's directory, for
        ``trainer.train(resume_from_checkpoint=)``; None on a first start."""
        point = self.run.resume_point()
        self._resumed = point.path if point is not None else None
        return self._resumed

    # -- the Trainer's hooks ------------------------------------------------------------
    def on_init_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        """Refuse an ``output_dir`` other than ``<root>/<job>`` while the Trainer is being
        built: its checkpoints would land where the coordinator does not look."""
        check_output_dir(args, self.run.job_dir)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        # The process group is up (TrainingArguments made accelerate's state) and the
        # optimizer exists: the Checkpointer's side group is a collective, made here on
        # every rank; then every rank checks it resumes from the same checkpoint.
        self._clipping = bool(args.max_grad_norm) and args.max_grad_norm > 0
        self.run.start(model, optimizer)
        self.run.agree(self._resumed)
        self.run.loaded()  # the Trainer loads the checkpoint before this hook

    def on_step_begin(self, args: TrainingArguments, state: TrainerState,
                      control: TrainerControl, **kwargs: Any) -> None:
        if self._awaiting_log:  # HF did not log after all: close the step without its loss
            self._finish_step(None)
        self.run.steps.begin(state.global_step)

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState,
                              control: TrainerControl, model: Any = None,
                              **kwargs: Any) -> None:
        if self.run.grad_norm and not self._clipping and model is not None:
            from trainguard.torch.stats import grad_norm

            self.run.steps.report(grad_norm=grad_norm(model))
        self.run.steps.phase("optimizer")

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> TrainerControl:
        if self.run.steps.current is None:
            return control
        if control.should_log:
            # HF logs this step next (DefaultFlowCallback, which runs first, said so): its
            # loss, all-reduced and already read to the host by HF, comes with on_log.
            self._awaiting_log = True
            return control
        self._finish_step(control)
        return control

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, float] | None = None, **kwargs: Any) -> TrainerControl:
        if not self._awaiting_log or not logs or "loss" not in logs:
            return control
        metrics: dict[str, float] = {"loss": logs["loss"]}
        norm = logs.get("grad_norm")
        if self.run.grad_norm and self._clipping and norm is not None and not math.isnan(norm):
            metrics["grad_norm"] = norm
        self.run.steps.report(**metrics)
        self._finish_step(control)
        return control

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> TrainerControl:
        """HF wrote ``checkpoint-<global_step>`` (every rank calls this, each after writing
        its own part: rank 0 the model, optimizer and state, every rank its RNG file)."""
        step = state.global_step - 1
        written = self.run.job_dir / f"{HF_PREFIX}-{state.global_step}"  # = output_dir
        target = self.run.path_for(step)
        ckpt = self.run.checkpointer
        if ckpt is not None:
            if ckpt.distributed and ckpt.world_size > 1:
                import torch.distributed as dist

                dist.barrier(group=ckpt.group)  # every rank's files are written
            if ckpt.group_rank == 0 and written.is_dir():
                if target.exists():  # an uncommitted leftover of an earlier attempt
                    shutil.rmtree(target)
                written.rename(target)
        self.run.saved(step, target)
        # The step is saved: an epoch's end right after must not save it again.
        control.should_save = False
        return control

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        if self._awaiting_log:
            self._finish_step(None)
        self.run.steps.end()
        if self.run.checkpointer is not None:
            self.run.checkpointer.wait()
        self.run.close()

    def _finish_step(self, control: TrainerControl | None) -> None:
        """End the open step; ask HF to save it when it is due (``control`` None: too late
        to ask, the Trainer has moved on)."""
        self._awaiting_log = False
        step = self.run.steps.current
        if step is None:
            return
        if self.run.steps.end() and control is not None and self.run.save_due(step.n):
            control.should_save = True


def check_output_dir(args: TrainingArguments, job_dir: Path) -> None:
    """``output_dir`` is ``<root>/<job>``, or :class:`ConfigError` saying how to make it so."""
    out = args.output_dir
    if out is None or Path(out).resolve() != job_dir.resolve():
        raise ConfigError(
            f"TrainingArguments.output_dir={out!r}: trainguard commits the checkpoints the "
            f"Trainer writes under <root>/<job>; set output_dir={str(job_dir)!r} (or pass "
            "Trainguard(root=...) the parent of your output_dir and name the job after it)")
