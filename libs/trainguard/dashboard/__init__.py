"""The live web dashboard: ``trainguard dashboard`` (and ``trainguard up``).

One page for on-call, readable at thousands of ranks: the outliers first (stuck or stopped
ranks, then the slowest against the median, each with its step strip), the ranks grouped by
host or by the failure domain an incident lost together (counts, slowest, worst phase; the
calm groups collapsed), a per-rank heat map drawn on demand, the incident timeline with
cause, culprit, actions and times, goodput and the checkpoint line, updating live over
server-sent events that carry that bounded summary, not every rank.

It is no service (it imports the contract, core and runtime, never a service): it reads the
bus only (no Redis, no durable consumer, no leader) as the on-call role, like ``trainguard
events``, and the CLI runs it directly; ``board`` is the pure state (``rankview`` a rank,
``stepmedians`` each step's medians kept as reports arrive, ``grouped`` the grouped view's
pure parts), ``feed`` the bus side, ``server`` the HTTP side and ``static/index.html`` the
page (HTML, CSS and JS in one packaged file, no build step).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final

from trainguard.runtime.bus import connect_nats
from trainguard.runtime.config import Settings
from trainguard.runtime.ports import DEFAULT_BASE_PORT, OFFSETS

from .board import Board
from .feed import Feed
from .server import DashboardServer

__all__ = ["DEFAULT_PORT", "Board", "DashboardServer", "Feed", "run_dashboard"]

DEFAULT_PORT: Final = DEFAULT_BASE_PORT + OFFSETS["dashboard"]
"""9466: the dashboard's place among the fixed ports (``trainguard.runtime.ports``)."""


async def run_dashboard(settings: Settings, *, host: str = "127.0.0.1",
                        port: int = DEFAULT_PORT, job: str | None = None,
                        stop: asyncio.Event | None = None,
                        started: Callable[[DashboardServer], None] | None = None) -> None:
    """Serve the dashboard until ``stop`` is set (forever without one)."""
    stop = stop or asyncio.Event()
    nc = await connect_nats(settings.nats_url, name="trainguard-dashboard",
                            timeout=settings.connect_timeout,
                            access=settings.access.nats_options())
    board = Board(only_job=job)
    feed = Feed(nc, board, settings.prefix, job)
    server = DashboardServer(board)
    try:
        await feed.start()
        await server.start(host, port)
        if started:
            started(server)
        await stop.wait()
    finally:
        await server.stop()
        await feed.stop()
        await nc.close()
