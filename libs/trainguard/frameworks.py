"""What the framework callbacks share (``trainguard.lightning``, ``trainguard.hf``).

A framework owns the loop, the process group and the checkpoint format; trainguard keeps
what it adds to a hand-written loop: each step reported with its phases, loss and gradient
norm, the checkpoint interval and ``save_now`` answered, every checkpoint the framework
writes committed and verified by the coordinator, and a restart resumed from the newest
committed one. Recovery is the restart path: the framework's process group cannot be
re-formed in place from outside it, so the ranks do not declare in-place recovery and the
node agent restarts the group.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainguard.client import Guard
from trainguard.client.hooked import HookedSteps
from trainguard.contract.errors import TrainguardError
from trainguard.contract.schemas import ResumePoint

if TYPE_CHECKING:
    from trainguard.torch.checkpoint import Checkpointer

log = logging.getLogger("trainguard.frameworks")


class ResumeDisagreement(TrainguardError):
    """The ranks were given different checkpoints to resume from (a commit landed between
    their questions): loading would mix two steps' state, so the rank stops and the group
    restarts, asking again."""


class FrameworkRun:
    """One rank's trainguard side of a framework's training run.

    Args:
        guard: the rank's Guard; default: ``Guard(job=job)`` (rank, world size and host
            from torchrun's or ``trainguard launch``'s environment).
        job: the job's name when the Guard is made here.
        root: the checkpoint root; the framework's checkpoints go to ``<root>/<job>/...``.
        format: the framework's checkpoint format, as committed (``lightning``, ``hf``).
        grad_norm: report the total gradient norm of each step (a fused norm over the
            gradients, read later without a host sync).
        checkpoint_every: the checkpoint interval in steps until the coordinator sets one
            (the Guard's ``checkpoint_every``), when the Guard is made here.
    """

    def __init__(self, guard: Guard | None, *, job: str | None,
                 root: str | os.PathLike[str], format: str, grad_norm: bool = True,
                 checkpoint_every: int | None = None) -> None:
        self.guard = guard if guard is not None else \
            Guard(job=job, checkpoint_every=checkpoint_every)
        self.root = Path(root)
        self.format = format
        self.grad_norm = grad_norm
        self.steps = HookedSteps(self.guard)
        self.checkpointer: Checkpointer | None = None
        self.save_requested: int | None = None
        """The step a ``save_now`` asked for, saved at the end of that step or the next."""
        self.guard.checkpoint_root = str(self.root)
        self._point: ResumePoint | None = None
        self._asked_at = 0.0

    @property
    def job_dir(self) -> Path:
        return self.root / self.guard.job

    def path_for(self, step: int) -> Path:
        """``<root>/<job>/step-<S>``: where step S's checkpoint is committed (the layout the
        coordinator commits, retains and points ``LATEST`` at)."""
        from trainguard.torch.checkpoint import step_dir

        return step_dir(self.root, self.guard.job, step)

    def resume_point(self) -> ResumePoint | None:
        """The newest committed checkpoint (the coordinator, else ``<root>/<job>/LATEST``),
        asked by this rank alone: frameworks take the path before their process group
        exists. :meth:`agree` checks, once it does, that every rank got the same."""
        self._asked_at = time.time()
        self._point = self.guard.resume_point(str(self.root))
        return self._point

    def loaded(self) -> None:
        """The framework restored the resume point (its first step is next): the incident
        learns where the job came back and where the time went."""
        if self._point is not None and self.checkpointer is not None:
            self.checkpointer.resumed(self._point, ready=self._asked_at, loaded=time.time())
            self._point = None

    def start(self, model: Any, optimizer: Any) -> Checkpointer:
        """After the framework's process group is up (collective: the Checkpointer makes
        its side group). The Checkpointer takes no memory snapshots and saves nothing of
        its own: it commits what the framework writes and answers ``save_now``."""
        from trainguard.torch.checkpoint import Checkpointer

        self.guard.attach(model, optimizer)
        if self.checkpointer is None:
            self.checkpointer = Checkpointer(self.guard, self.root, memory=None,
                                             saver=self._save_now)
        return self.checkpointer

    def agree(self, resumed: str | os.PathLike[str] | None) -> None:
        """Every rank resumes from the same checkpoint, or every rank raises
        :class:`ResumeDisagreement` (collective, on the Checkpointer's side group)."""
        ckpt = self.checkpointer
        if ckpt is None or not ckpt.distributed or ckpt.world_size < 2:
            return
        import torch.distributed as dist

        mine = str(resumed) if resumed is not None else ""
        everyone: list[Any] = [None] * ckpt.world_size
        dist.all_gather_object(everyone, mine, group=ckpt.group)
        if len(set(everyone)) > 1:
            raise ResumeDisagreement(
                f"ranks were told to resume from different checkpoints "
                f"({sorted(set(map(str, everyone)))}): restarting to ask again")

    def _save_now(self, step: int) -> int:
        """``save_now`` at a safe point: saved when the step ends (a framework saves at a
        step's end). At a step's exit that is ``step``; at a step's entry, the open one."""
        current = self.steps.current
        due = current.n if current is not None and current.n > step else step
        self.save_requested = due
        return due

    def save_due(self, step: int) -> bool:
        """Whether the framework should save after ``step``: the checkpoint interval, or a
        ``save_now`` (identical on every rank: both are agreed)."""
        if self.save_requested is not None and self.save_requested <= step:
            return True
        return self.guard.should_checkpoint(step)

    def saved(self, step: int, path: str | os.PathLike[str]) -> None:
        """The framework wrote ``step`` at ``path`` on every rank: report it for commit
        (collective)."""
        if self.save_requested is not None and self.save_requested <= step:
            self.save_requested = None
        if self.checkpointer is not None:
            self.checkpointer.commit(step, format=self.format, path=path)

    def close(self) -> None:
        """Leave an open step, finish the commit in flight and close the Guard."""
        self.steps.end()
        self.guard.close()
