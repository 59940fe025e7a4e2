"""How every trainguard process connects to NATS: one set of options, callers add their own.

The services' bus (:func:`trainguard.runtime.bus.connect_nats`) and the trainer client's transport
connect with the same reconnect, ping and timeout policy; each adds only what differs (its
name, its callbacks, the client's small ``pending_size``) and bounds its own first connect.

Reconnects go on forever: a training job outlives any NATS outage, and nats-py's default
gives up after about two minutes. The price is that ``connect`` to a dead URL never
returns, so the *first* connect must be bounded by the caller (``asyncio.wait_for``).
This module imports nothing but the standard library, so the client may use it cheaply.
"""

from __future__ import annotations

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
