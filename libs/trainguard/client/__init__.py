"""The trainer client: :class:`Guard` and its step/phase context managers."""

from __future__ import annotations

from .commands import DrillCrash
from .guard import Guard
from .handle import GuardHandle
from .steps import Phase, Step

__all__ = ["DrillCrash", "Guard", "GuardHandle", "Phase", "Step"]
