"""The trainer client: :class:`Guard` and its step/phase context managers."""

from __future__ import annotations

from .commands import DrillCrash
from .guard import Guard, Phase, Step

__all__ = ["DrillCrash", "Guard", "Phase", "Step"]
