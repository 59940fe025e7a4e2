"""One rank as the board keeps it: its newest steps and where it is now.

Apart from :mod:`.board` so that :mod:`.grouped` reads it without importing the board.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Final

from trainguard.contract.schemas import StepReport

STEPS_SHOWN: Final = 40
"""Columns of a rank's step strip: its newest steps."""
COMM_PHASES: Final = frozenset({"comm"})
"""Collective wait: a rank's own compute is its step time minus these (DDP ranks report
``comm`` from the communication hook)."""


@dataclass
class RankView:
    rank: int
    host: str = ""
    step: int | None = None
    phase: str | None = None
    phase_elapsed: float = 0.0
    state: str = ""
    """The agent's process state letter (R, S, T, D, ...), if an agent reports it."""
    seen: float = 0.0
    """Sender's clock of the newest heartbeat."""
    steps: deque[tuple[int, float, float]] = field(
        default_factory=lambda: deque(maxlen=STEPS_SHOWN))
    """(step, compute seconds, total seconds) of the newest steps."""


def compute_time(report: StepReport) -> float:
    """The rank's own work in a step: its duration without collective wait."""
    waits = sum(v for k, v in report.phases.items() if k in COMM_PHASES)
    return max(0.0, report.duration - waits) if report.duration else \
        sum(v for k, v in report.phases.items() if k not in COMM_PHASES)
