"""The trainer client, what a rank runs: :class:`Guard`, its step/phase context managers,
the command desk, transport, reports and drills.

Torch-free and light: it imports the contract, core and the torch-free modules of
:mod:`trainguard.recovery` (agreement, loop, handle), never the runtime, the analysis or a
service (import-linter, ``make lint``). A tensor the trainer hands it is read through
:mod:`trainguard.torch` helpers, loaded only then."""

from __future__ import annotations

from trainguard.contract.errors import DrillCrash, SkipStep
from trainguard.recovery.handle import GuardHandle

from .guard import Guard
from .steps import Phase, Step

__all__ = ["DrillCrash", "Guard", "GuardHandle", "Phase", "SkipStep", "Step"]
