"""``with guard.step(n) as s:`` and ``with s.phase(name):``, the training loop's handles.

They only read clocks and write the shared :class:`~.rankstate.RankState`; what a finished
step becomes (a report, commands run at the safe point) is the Guard's, reached through
the two callbacks it hands each :class:`Step`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, Protocol

from trainguard.contract.errors import SkipStep
from trainguard.contract.evidence import BatchFault
from trainguard.core.rankstate import RankState

from .values import plain_float


class StepEnds(Protocol):
    def __call__(self, step: Step, duration: float, *, failed: bool,
                 error: BaseException | None = None) -> bool:
        """True absorbs ``error``: the step is abandoned and the loop recovers in place."""
        ...


class Phase:
    """``with s.phase("data"):`` — times one named phase and marks it as current."""

    __slots__ = ("_name", "_step", "_t0")

    def __init__(self, step: Step, name: str) -> None:
        self._step = step
        self._name = name
        self._t0 = 0.0

    def __enter__(self) -> Phase:
        self._t0 = time.perf_counter()
        self._step.state.enter(self._name)
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        elapsed = time.perf_counter() - self._t0
        state = self._step.state
        if state.slow_factor > 1.0 and self._name == "compute":
            time.sleep(elapsed * (state.slow_factor - 1.0))  # the `slow` drill
            elapsed *= state.slow_factor
        phases = self._step.phases
        phases[self._name] = phases.get(self._name, 0.0) + elapsed
        state.enter("step")


class Step:
    """``with guard.step(n) as s:`` — one training step.

    ``on_enter(step)`` runs as it begins; ``on_exit(step, seconds, failed=..., error=...)``
    as it ends, and decides whether a failure is absorbed (a lost peer inside
    ``guard.steps``, recovered in place).
    """

    __slots__ = ("_on_enter", "_on_exit", "_t0", "batch_fault", "done", "extra", "grad_norm",
                 "loss", "lr", "n", "phases", "samples", "skipped", "state", "tokens")

    def __init__(self, n: int, state: RankState, on_enter: Callable[[Step], None],
                 on_exit: StepEnds) -> None:
        self.n = n
        self.state = state
        self._on_enter = on_enter
        self._on_exit = on_exit
        self.phases: dict[str, float] = {}
        self.loss: Any = None
        self.grad_norm: Any = None
        self.tokens: int | None = None
        self.samples: int | None = None
        self.lr: float | None = None
        self.extra: dict[str, Any] | None = None
        self.batch_fault: BatchFault | None = None
        """What the batch check found wrong with this step's batch (reported with it)."""
        self.skipped = False
        """The step ended by :class:`SkipStep`: no update was made."""
        self.done = False
        """Set as the step ends: it ran to its end, so the per-step work after the ``with``
        block (logging, counting, a checkpoint) is due. False for a step a lost peer
        abandoned (it runs again) and for a skipped one."""
        self._t0 = 0.0

    def phase(self, name: str) -> Phase:
        return Phase(self, name)

    def report(self, loss: Any = None, grad_norm: Any = None, tokens: int | None = None,
               samples: int | None = None, lr: Any = None, **extra: Any) -> None:
        """Attach metrics; numbers or 0-dim tensors (read later, without a host sync).

        ``lr``: the learning rate of this step, when the attached optimizer does not tell
        it (the detector restarts its loss and gradient baselines when it changes)."""
        if loss is not None:
            self.loss = loss
        if grad_norm is not None:
            self.grad_norm = grad_norm
        if tokens is not None:
            self.tokens = tokens
        if samples is not None:
            self.samples = samples
        if lr is not None:
            # Also an extra, as before ``lr`` had a field of its own; a tensor LR is left
            # to the extras' deferred read (reading it here could wait for the device).
            self.lr = plain_float(lr)
            extra["lr"] = lr
        if extra:
            self.extra = extra

    def __enter__(self) -> Step:
        self._on_enter(self)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> bool:
        try:
            if isinstance(ev, SkipStep):
                self.skipped = True
                self.loss = self.grad_norm = None  # nothing of the skipped step is a result
                self._on_exit(self, time.perf_counter() - self._t0, failed=False)
                return True
            absorbed = self._on_exit(self, time.perf_counter() - self._t0,
                                     failed=et is not None, error=ev)
            self.done = et is None
            return absorbed
        finally:
            # Read and reported by now: a step that ended holds none of the trainer's
            # tensors (a sharded model's gradient norm is a DTensor that holds its mesh,
            # whose groups an in-place re-form must be able to close).
            self.loss = self.grad_norm = self.extra = None
