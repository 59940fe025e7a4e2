"""How every trainguard process connects to NATS: one set of options, callers add their own.

The services' bus (:func:`trainguard.runtime.bus.connect_nats`) and the trainer client's transport
connect with the same reconnect, ping and timeout policy; each adds only what differs (its
name, its callbacks, the client's small ``pending_size``) and bounds its own first connect.

Reconnects go on forever: a training job outlives any NATS outage, and nats-py's default
gives up after about two minutes. The price is that ``connect`` to a dead URL never
returns, so the *first* connect must be bounded by the caller (``asyncio.wait_for``).
:func:`flush` is the one way to flush (nats-py's own breaks the read loop on a timeout).
This module imports nothing but the standard library, so the client may use it cheaply.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, Final

ErrorCallback = Callable[[Exception], Awaitable[None]]
EventCallback = Callable[[], Awaitable[None]]

RECONNECT_WAIT: Final = 0.5
"""Seconds between reconnect attempts (nats-py's 2 s would lengthen every outage)."""
PING_INTERVAL: Final = 120
MAX_OUTSTANDING_PINGS: Final = 2
"""A silent server is declared gone after PING_INTERVAL * MAX_OUTSTANDING_PINGS seconds
(nats-py's defaults, spelled here so that one place tunes them)."""


NEVER: Final = 365 * 24 * 3600.0
"""A flush timeout that never ends (see :func:`flush`)."""
DEFAULT_FLUSH_S: Final = 10.0

FLUSH_ROUNDS: Final = 3
"""PINGs one :func:`flush` sends at most (see there)."""

_flushes: set[asyncio.Future[Any]] = set()
"""PINGs still waiting for their PONG after their caller stopped waiting."""


async def flush(nc: Any, timeout: float = DEFAULT_FLUSH_S) -> None:
    """Wait until the server has everything written so far (a PING answered), at most
    ``timeout`` seconds: ``TimeoutError`` after that, the connection's error if it closes.

    Never ``nc.flush(timeout)`` itself: on a timeout (and when a ``wait_for`` around it is
    cancelled) nats-py cancels the PONG's future, the PONG that comes later fails
    ``set_result`` inside the read loop, and the loop ends for good while the client still
    says it is connected: it never receives again. Here the PING waits without a bound in
    a task that outlives our wait, so its PONG always finds a live future.

    nats-py writes its PING straight to the socket, ahead of commands still queued for its
    flusher task (a SUB just made, say): on a busy machine the PONG can come back before
    the server has them. So a PING counts only when nothing was queued as it went out;
    if something was, the PING has set the flusher going, and the next round covers it
    (at most :data:`FLUSH_ROUNDS`: a connection that never stops publishing must not keep
    its flush waiting for a quiet moment)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    for _ in range(FLUSH_ROUNDS):
        queued = nc.pending_data_size
        await _ping(nc, deadline - loop.time(), timeout)
        if not queued:
            return


async def _ping(nc: Any, left: float, timeout: float) -> None:
    ping = asyncio.ensure_future(nc.flush(timeout=NEVER))
    _flushes.add(ping)
    ping.add_done_callback(_forget)
    done, _ = await asyncio.wait({ping}, timeout=max(left, 0.0))
    if ping not in done:
        raise TimeoutError(f"the NATS server did not answer a flush within {timeout:g} s")
    ping.result()


def _forget(ping: asyncio.Future[Any]) -> None:
    _flushes.discard(ping)
    if not ping.cancelled():
        with contextlib.suppress(BaseException):
            ping.exception()  # retrieved: a closed connection's error is the caller's news


def connect_options(
    url: str,
    *,
    name: str,
    connect_timeout: float,
    error_cb: ErrorCallback,
    disconnected_cb: EventCallback | None = None,
    reconnected_cb: EventCallback | None = None,
    pending_size: int | None = None,
) -> dict[str, Any]:
    """Keyword arguments of ``nats.aio.client.Client.connect``.

    Args:
        url: one server URL or several separated by commas.
        name: the connection name the server shows (``trainguard-<service>``).
        connect_timeout: bound of one connect attempt (the first connect as a whole is the
            caller's to bound).
        error_cb: nats-py logs to stderr without one; callers count or log errors.
        disconnected_cb, reconnected_cb: optional connection events.
        pending_size: bytes buffered while disconnected (None: nats-py's 2 MiB).
    """
    options: dict[str, Any] = {
        # Every server of a cluster: nats-py tries them in random order, fails over to the
        # next on a lost connection, and adds the servers the cluster announces.
        "servers": [u.strip() for u in url.split(",") if u.strip()],
        "name": name,
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": RECONNECT_WAIT,
        "ping_interval": PING_INTERVAL,
        "max_outstanding_pings": MAX_OUTSTANDING_PINGS,
        "connect_timeout": connect_timeout,
        "error_cb": error_cb,
    }
    optional = {"disconnected_cb": disconnected_cb, "reconnected_cb": reconnected_cb,
                "pending_size": pending_size}
    options.update({k: v for k, v in optional.items() if v is not None})
    return options
