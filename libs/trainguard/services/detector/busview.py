"""The detector's view of its own bus: is what it hears current, or is the bus stalled?

A frozen or partitioned NATS server delivers nothing to anyone: every rank falls silent at
once, and judging that silence would report every rank of every job as failing (a page for
what is one bus fault). So the detector measures its own bus: a PING/PONG round trip to
the server every ``bus_probe_interval`` (``nc.flush``: core NATS, no subject, no
permission needed). The view is *current* while the newest answered probe was **sent**
within ``bus_stale_after``: a probe sent before a stall and answered after it proves only
that the server was alive when it was sent. A disconnect, or a reconnect between two ticks,
is a stall too.

While the view is stale the detector judges no silence and no hang, and for one
``hb_timeout`` after it is current again (:meth:`~.engine.Detector.grace`): the ranks'
buffered telemetry arrives late and is judged by its sender time. The stall itself is one
bus fault, not a job's: it is logged and exported as metrics, never raised as an anomaly
per job or per rank (alerting on the bus belongs to the NATS server's own monitoring).

:class:`BusView` is the pure rule; :class:`BusProbe` runs the round trips.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any, Literal

from trainguard.core.connection import NEVER, flush

Freshness = Literal["current", "stale", "recovered"]
"""``current``: judge as usual. ``stale``: judge no silence or hang. ``recovered``: the
first tick current again (the caller starts the grace)."""


class BusView:
    """Whether the detector's view of the bus is current (pure: times are given).

    Args:
        stale_after: the newest answered probe must have been sent within this long.
        now: when the connection was made (connecting proved the bus).
    """

    def __init__(self, stale_after: float, now: float, reconnects: int = 0) -> None:
        self.stale_after = stale_after
        self.confirmed = now
        """Send time of the newest answered probe: the bus carried traffic then."""
        self.reconnects = reconnects
        self.stale_since: float | None = None
        self.stalls = 0
        self.rtt: float | None = None

    def answered(self, sent: float, at: float) -> None:
        """A probe sent at ``sent`` came back at ``at``."""
        self.confirmed = max(self.confirmed, sent)
        self.rtt = max(0.0, at - sent)

    def observe(self, now: float, connected: bool, reconnects: int) -> Freshness:
        """Once a tick: is the view current now?"""
        reconnected = reconnects != self.reconnects
        self.reconnects = reconnects
        current = connected and not reconnected and now - self.confirmed <= self.stale_after
        if current:
            if self.stale_since is None:
                return "current"
            self.stale_since = None
            return "recovered"
        if self.stale_since is None:
            self.stale_since = now
            self.stalls += 1
        return "stale"

    def stale_for(self, now: float) -> float:
        """How long the view has been stale (0 while current)."""
        return 0.0 if self.stale_since is None else now - self.stale_since


class BusProbe:
    """One PING/PONG round trip at a time, feeding a :class:`BusView`.

    nats-py pitfall: ``flush(timeout)`` cancels its PONG future on timeout but leaves it
    queued, and the PONG that arrives later (a stalled server resumes) is set on the
    cancelled future: ``InvalidStateError`` ends the client's read loop for good, with no
    reconnect. So a probe is never cancelled while its connection lives: it waits with no
    timeout of its own, and staleness is judged from outside by its send time. A probe
    whose connection was replaced (a reconnect: nats-py drops the old futures) is abandoned.
    """

    def __init__(self, nc: Any, view: BusView, clock: Callable[[], float] = time.time) -> None:
        self.nc = nc
        self.view = view
        self.clock = clock
        self._task: asyncio.Task[None] | None = None
        self._reconnects = nc.stats["reconnects"]

    def poke(self) -> None:
        """Send a probe unless one is still out (call every ``bus_probe_interval``)."""
        reconnects = self.nc.stats["reconnects"]
        if self._task is not None and reconnects != self._reconnects:
            self._task.cancel()  # its PING went down with the old connection
            self._task = None
        if self._task is not None or not self.nc.is_connected:
            return
        self._reconnects = reconnects
        self._task = asyncio.create_task(self._round_trip(self.clock()),
                                         name="detector:bus-probe")

    async def _round_trip(self, sent: float) -> None:
        try:
            await flush(self.nc, NEVER)
        except Exception:  # closed or reconnecting: the view goes stale by itself
            return
        finally:
            if self._task is asyncio.current_task():
                self._task = None
        self.view.answered(sent, self.clock())

    async def close(self, wait: float = 1.0) -> None:
        """Let an outstanding probe finish (normally milliseconds) before the bus closes."""
        task = self._task
        if task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait({task}, timeout=wait)
