"""Sliding windows and robust statistics (median and MAD, never mean and stdev).

Training telemetry has heavy tails: a checkpoint step, a slow batch, a GC pause. A mean
and a standard deviation are dragged by every one of those; the median and the median
absolute deviation (MAD) ignore up to half the window, which is what lets the rules use
tight thresholds without firing on ordinary jitter.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

ROBUST_SIGMA = 1.4826
"""MAD x this estimates the standard deviation of normally distributed data."""


def median(values: Sequence[float]) -> float:
    """The median of a non-empty sequence (mean of the middle two for an even count)."""
    ordered = sorted(values)
    n = len(ordered)
    mid = n // 2
    if n % 2:
        return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) / 2.0


def median_mad(values: Sequence[float]) -> tuple[float, float]:
    """Median and median absolute deviation of a non-empty sequence."""
    med = median(values)
    return med, median([abs(v - med) for v in values])


class Ring:
    """A fixed-capacity window of floats with order statistics cached between adds.

    Rules read quantiles far more often than the window changes (every tick versus
    once per step), so the sorted copy is kept until the next :meth:`add`.
    """

    __slots__ = ("_buf", "_cap", "_next", "_sorted")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("a window needs a capacity of at least 1")
        self._buf: list[float] = []
        self._cap = capacity
        self._next = 0
        self._sorted: list[float] | None = None

    def __len__(self) -> int:
        return len(self._buf)

    @property
    def capacity(self) -> int:
        return self._cap

    @property
    def full(self) -> bool:
        return len(self._buf) == self._cap

    def add(self, value: float) -> None:
        if len(self._buf) < self._cap:
            self._buf.append(value)
        else:
            self._buf[self._next] = value
            self._next = (self._next + 1) % self._cap
        self._sorted = None

    def extend(self, values: Iterable[float]) -> None:
        for v in values:
            self.add(v)

    def clear(self) -> None:
        self._buf.clear()
        self._next = 0
        self._sorted = None

    def values(self) -> list[float]:
        """The window in arrival order, oldest first."""
        return self._buf[self._next:] + self._buf[: self._next]

    def _order(self) -> list[float]:
        if self._sorted is None:
            self._sorted = sorted(self._buf)
        return self._sorted

    def quantile(self, q: float) -> float | None:
        """Nearest-rank quantile (``q`` in [0, 1]); None for an empty window."""
        ordered = self._order()
        if not ordered:
            return None
        idx = min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.999999) - 1))
        return ordered[idx]

    def median(self) -> float | None:
        ordered = self._order()
        if not ordered:
            return None
        n = len(ordered)
        mid = n // 2
        return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0

    def median_mad(self) -> tuple[float, float] | None:
        med = self.median()
        if med is None:
            return None
        return med, median([abs(v - med) for v in self._buf])

    def max(self) -> float | None:
        ordered = self._order()
        return ordered[-1] if ordered else None


class FlagHistory:
    """The last ``window`` yes/no verdicts with a running count of the yeses.

    "At least 8 flagged steps out of the last 10" is then O(1) per step.
    """

    __slots__ = ("_flags", "count")

    def __init__(self, window: int) -> None:
        self._flags: deque[bool] = deque(maxlen=window)
        self.count = 0

    def __len__(self) -> int:
        return len(self._flags)

    @property
    def full(self) -> bool:
        return len(self._flags) == self._flags.maxlen

    def push(self, flag: bool) -> None:
        flags = self._flags
        if len(flags) == flags.maxlen and flags[0]:
            self.count -= 1
        flags.append(flag)
        if flag:
            self.count += 1

    def clear(self) -> None:
        self._flags.clear()
        self.count = 0
