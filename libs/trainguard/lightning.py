"""``trainguard.lightning.Trainguard``: a PyTorch Lightning callback.

.. code-block:: python

    guard = trainguard.lightning.Trainguard(job="llama-8b", root="/ckpt")
    trainer = L.Trainer(strategy="ddp", callbacks=[guard], max_steps=10_000)
    trainer.fit(model, data, ckpt_path=guard.resume_path())

It reports each optimizer step (phases ``compute`` and ``optimizer``, loss, gradient
norm), saves Lightning checkpoints at the interval the coordinator sets and on
``save_now`` (``<root>/<job>/step-<S>/lightning.ckpt``), reports each for commit, and
``resume_path()`` names the newest committed one, so a restarted group goes on from it.
Lightning owns its process group: a lost rank restarts the group (docs/lightning.md).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from trainguard.client import Guard
from trainguard.frameworks import FrameworkRun

CHECKPOINT_FILE = "lightning.ckpt"


class Trainguard(Callback):
    """The Lightning callback (one per trainer).

    Args:
        job: the job's name (default: ``TRAINGUARD_JOB``).
        root: the checkpoint root, shared by every host.
        guard: a Guard of your own, instead of one made here.
        grad_norm: report each step's total gradient norm (a fused norm over the gradients
            before the optimizer step; no host sync).
        checkpoint_every: save every this many steps until the coordinator sets the
            interval (None: only when it does, or on ``save_now``).
    """

    def __init__(self, job: str | None = None, root: str | os.PathLike[str] = "checkpoints",
                 *, guard: Guard | None = None, grad_norm: bool = True,
                 checkpoint_every: int | None = None) -> None:
        self.run = FrameworkRun(guard, job=job, root=root, format="lightning",
                                grad_norm=grad_norm, checkpoint_every=checkpoint_every)
        self.guard = self.run.guard
        self._resumed: str | None = None

    def resume_path(self) -> str | None:
        """The newest committed checkpoint's file, for ``trainer.fit(..., ckpt_path=)``;
        None on a first start."""
        point = self.run.resume_point()
        self._resumed = str(Path(point.path) / CHECKPOINT_FILE) if point is not None else None
        return self._resumed

    # -- Lightning's hooks ------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        self.run.start(pl_module, optimizer)
        self.run.agree(trainer.ckpt_path if trainer.ckpt_path is not None else self._resumed)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.guard.attach(pl_module, trainer.optimizers[0] if trainer.optimizers else None)
        self.run.loaded()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        if self.run.steps.current is None:  # gradient accumulation: the step's first batch
            self.run.steps.begin(trainer.global_step)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: Any) -> None:
        if self.run.grad_norm:
            from trainguard.torch.stats import grad_norm

            self.run.steps.report(grad_norm=grad_norm(pl_module))
        self.run.steps.phase("optimizer")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        step = self.run.steps.current
        if step is None or trainer.global_step <= step.n:
            return  # accumulating: the optimizer has not stepped yet
        # Lightning hands the step's loss detached; the Guard reads it later, unsynced.
        self.run.steps.report(loss=outputs.get("loss") if isinstance(outputs, dict) else outputs)
        if self.run.steps.end() and self.run.save_due(step.n):
            path = self.run.path_for(step.n)
            trainer.save_checkpoint(path / CHECKPOINT_FILE, weights_only=False)
            self.run.saved(step.n, path)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        self.run.steps.fail(exception)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.run.steps.end()
        if self.run.checkpointer is not None:
            self.run.checkpointer.wait()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.run.close()
