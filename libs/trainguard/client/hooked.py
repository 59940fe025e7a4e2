"""A step one hook opens and a later one closes: ``with guard.step(n)`` for a framework whose
loop the user does not write (Lightning, the Hugging Face Trainer).

Such a framework calls back at the start of a batch, before the optimizer step and at the
end of the batch; this class holds the open :class:`~.steps.Step` between those calls and
ends it exactly once, so a step is reported, and its safe points run, as in a hand-written
loop. It allocates nothing per step beyond the Step itself.
"""

from __future__ import annotations

from typing import Any, Protocol

from .steps import Phase, Step


class Steps(Protocol):
    """What of the Guard the adapter needs."""

    def step(self, n: int) -> Step: ...


class HookedSteps:
    """Open, re-phase and close one step at a time across a framework's hooks.

    ``begin(n)`` enters the Guard's step (its entry safe point runs here: commands such as
    ``save_now`` may act before the step), ``phase(name)`` ends the running phase and starts
    ``name``, ``report(...)`` attaches metrics, ``end()`` leaves the step (its exit safe
    point) and says whether it ran to its end. A ``begin`` while a step is open ends that
    one first (a framework that skipped its end hook, e.g. on a skipped batch).
    """

    __slots__ = ("_guard", "_phase", "_phase_name", "_step")

    def __init__(self, guard: Steps) -> None:
        self._guard = guard
        self._step: Step | None = None
        self._phase: Phase | None = None
        self._phase_name = ""

    @property
    def current(self) -> Step | None:
        """The open step, or None between steps."""
        return self._step

    def begin(self, n: int, phase: str = "compute") -> Step:
        if self._step is not None:
            self.end()
        step = self._guard.step(n)
        step.__enter__()
        self._step = step
        self._start_phase(phase)
        return step

    def phase(self, name: str) -> None:
        """End the running phase and start ``name`` (no-op between steps)."""
        if self._step is None or name == self._phase_name:
            return
        self._end_phase()
        self._start_phase(name)

    def report(self, **metrics: Any) -> None:
        """``Step.report`` on the open step (no-op between steps)."""
        if self._step is not None:
            self._step.report(**metrics)

    def end(self) -> bool:
        """Leave the open step; True when it ran to its end (``Step.done``)."""
        step = self._step
        if step is None:
            return False
        self._end_phase()
        self._step = None
        step.__exit__(None, None, None)
        return step.done

    def fail(self, error: BaseException) -> None:
        """Leave the open step as failed by ``error`` (the framework is unwinding)."""
        step = self._step
        if step is None:
            return
        self._end_phase()
        self._step = None
        step.__exit__(type(error), error, error.__traceback__)

    def _start_phase(self, name: str) -> None:
        if self._step is not None and name:
            self._phase = self._step.phase(name)
            self._phase.__enter__()
            self._phase_name = name

    def _end_phase(self) -> None:
        phase, self._phase, self._phase_name = self._phase, None, ""
        if phase is not None:
            phase.__exit__(None, None, None)
