"""Young/Daly: how often to checkpoint, from what a save costs and how often the job fails.

T = sqrt(2 · C · MTBF) minimises the expected work lost to failures plus the time spent
saving, where C is what a save costs the training loop (the *blocking* seconds: an async
save's write runs beside training) and MTBF the job's mean time between failures.

The MTBF starts at a configured prior and learns from the job's history with the prior
counted as one pseudo-failure: MTBF = (prior + observed) / (1 + failures). A job that has
run twice the prior without failing gets a longer interval; one that fails every few
minutes a shorter one, and a single early failure does not collapse the estimate.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class IntervalDecision:
    every_steps: int
    seconds: float
    """The clamped Young/Daly period."""
    raw_seconds: float
    """sqrt(2 C MTBF) before clamping."""
    cost: float
    mtbf: float
    failures: int
    publish: bool
    """True when no interval was published yet or it moved by more than the fraction."""


@dataclass(frozen=True)
class IntervalPolicy:
    min_seconds: float = 60.0
    max_seconds: float = 3600.0
    mtbf_prior: float = 86400.0
    change_fraction: float = 0.2

    def mtbf(self, failures: int, observed: float) -> float:
        return (self.mtbf_prior + max(0.0, observed)) / (1 + max(0, failures))

    def period(self, cost: float, mtbf: float) -> tuple[float, float]:
        """(clamped, raw) Young/Daly period in seconds."""
        raw = math.sqrt(2.0 * max(0.0, cost) * max(0.0, mtbf))
        return min(self.max_seconds, max(self.min_seconds, raw)), raw

    @staticmethod
    def cost(blocked: Sequence[float]) -> float | None:
        """C from recent saves: the median of their blocking seconds (robust to one slow
        save); None without any measurement."""
        values = [b for b in blocked if b >= 0 and math.isfinite(b)]
        return statistics.median(values) if values else None

    def decide(self, *, blocked: Sequence[float], failures: int, observed: float,
               step_time: float, current_steps: int | None) -> IntervalDecision | None:
        """The interval in steps, or None when it cannot be computed (no save measured yet,
        or no step time)."""
        cost = self.cost(blocked)
        if cost is None or not (step_time > 0 and math.isfinite(step_time)):
            return None
        mtbf = self.mtbf(failures, observed)
        seconds, raw = self.period(cost, mtbf)
        steps = max(1, round(seconds / step_time))
        publish = current_steps is None or current_steps <= 0 or \
            abs(steps - current_steps) / current_steps > self.change_fraction
        return IntervalDecision(steps, seconds, raw, cost, mtbf, failures, publish)
