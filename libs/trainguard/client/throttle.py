"""The newest of a stream of reports, at most one per interval (memory snapshot reports).

A rank may take a memory snapshot every step; the control plane needs to know the newest
one, not each. :class:`Latest` lets the first report through at once, holds the ones that
come sooner than ``interval`` after the last sent (each replacing the one held) and gives
the held one out once the interval is over (the Guard's transport thread asks every
interval), so the newest always reaches the bus, at most ``interval`` late.
"""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

T = TypeVar("T")


class Latest(Generic[T]):
    """At most one item per ``interval`` seconds, the newest; thread-safe (items are
    offered on one thread and collected on another)."""

    def __init__(self, interval: float) -> None:
        if interval < 0:
            raise ValueError(f"interval={interval}: must be >= 0")
        self.interval = interval
        self.held: T | None = None
        self.suppressed = 0
        """Items replaced by a newer one before they went out."""
        self._sent: float | None = None
        self._lock = threading.Lock()

    def offer(self, item: T, now: float) -> T | None:
        """``item`` if it may go out now (then it counts as sent), else None: it is held,
        replacing the one held before."""
        with self._lock:
            if self._sent is None or now - self._sent >= self.interval:
                self._sent, self.held = now, None
                return item
            if self.held is not None:
                self.suppressed += 1
            self.held = item
            return None

    def due(self, now: float) -> T | None:
        """The held item once the interval since the last sent is over (it counts as sent
        now), else None."""
        with self._lock:
            if self.held is None or (self._sent is not None
                                     and now - self._sent < self.interval):
                return None
            item, self.held, self._sent = self.held, None, now
            return item

    def flush(self) -> T | None:
        """The held item whatever the time (on the way out), else None."""
        with self._lock:
            item, self.held = self.held, None
            return item
