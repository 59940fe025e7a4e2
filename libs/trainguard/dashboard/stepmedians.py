"""Each step's median compute and step time over the ranks, kept as reports arrive.

Reading them must stay cheap at 16k ranks (the page's summary is built after every change):
a step's median is computed again only when it got reports since the last read, so a read
sorts the newest step or two, not 40 steps of every rank.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Final

KEPT: Final = 80
"""Steps kept (twice a rank's strip: a restart goes back a few)."""


@dataclass
class StepMedians:
    compute: dict[int, list[float]] = field(default_factory=dict)
    total: dict[int, list[float]] = field(default_factory=dict)
    dirty: set[int] = field(default_factory=set)
    medians: dict[int, tuple[float, float | None]] = field(default_factory=dict)
    """step -> (median compute, median step time or None)."""

    def add(self, step: int, compute: float, total: float) -> None:
        """One rank's report of ``step`` (a step re-run after a restart adds to it)."""
        self.compute.setdefault(step, []).append(compute)
        if total:
            self.total.setdefault(step, []).append(total)
        self.dirty.add(step)
        if len(self.compute) > KEPT:
            oldest = min(self.compute)
            for d in (self.compute, self.total, self.medians):
                d.pop(oldest, None)
            self.dirty.discard(oldest)

    def read(self) -> dict[int, tuple[float, float | None]]:
        """Every kept step's medians, recomputing only the steps with new reports."""
        for s in self.dirty:
            totals = self.total.get(s)
            self.medians[s] = (statistics.median(self.compute[s]),
                               statistics.median(totals) if totals else None)
        self.dirty.clear()
        return self.medians

    def recent(self, last: int) -> tuple[float | None, float | None]:
        """Median compute and median step time over the newest ``last`` steps' medians."""
        medians = self.read()
        steps = sorted(medians)[-last:]
        computes = [medians[s][0] for s in steps]
        totals = [t for s in steps if (t := medians[s][1]) is not None]
        return (statistics.median(computes) if computes else None,
                statistics.median(totals) if totals else None)
