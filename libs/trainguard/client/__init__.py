"""The trainer client: :class:`Guard` and its step/phase context managers."""

from __future__ import annotations

from trainguard.contract.errors import DrillCrash
from trainguard.recovery.handle import GuardHandle

from .guard import Guard
from .steps import Phase, Step

__all__ = ["DrillCrash", "Guard", "GuardHandle", "Phase", "Step"]
