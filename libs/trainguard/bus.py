"""The NATS connection every trainguard process uses, and the publish helpers.

The connection reconnects forever (``max_reconnect_attempts=-1``), so the *first*
connect has to be bounded by hand: with endless reconnects ``nats.connect`` to a dead
URL never returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js import api as js_api
from opentelemetry.context import Context

from . import tracing
from .codec import encode_durable, encode_telemetry
from .envelope import make_headers
from .schemas import DeadLetter, Durable, TelemetryMessage
from .subjects import Subjects

log = logging.getLogger("trainguard.bus")

ErrorCallback = Callable[[Exception], Awaitable[None]]


class BusUnavailable(ConnectionError):
    """The first connect to NATS did not succeed within its bound."""


async def connect_nats(
    url: str,
    *,
    name: str,
    timeout: float = 5.0,
    error_cb: ErrorCallback | None = None,
    disconnected_cb: Callable[[], Awaitable[None]] | None = None,
    reconnected_cb: Callable[[], Awaitable[None]] | None = None,
    pending_size: int | None = None,
) -> NATS:
    async def _default_error_cb(exc: Exception) -> None:
        log.debug("nats error: %r", exc)

    options: dict[str, Any] = {
        "servers": url.split(","),
        "name": name,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        "connect_timeout": min(2.0, timeout),
        "error_cb": error_cb or _default_error_cb,
    }
    if disconnected_cb:
        options["disconnected_cb"] = disconnected_cb
    if reconnected_cb:
        options["reconnected_cb"] = reconnected_cb
    if pending_size is not None:
        options["pending_size"] = pending_size
    nc = NATS()
    try:
        await asyncio.wait_for(nc.connect(**options), timeout)
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        await _close_quietly(nc)
        raise BusUnavailable(
            f"cannot reach NATS at {url} within {timeout:.0f}s ({exc!r}); is nats-server "
            "running? `trainguard up` starts one, or pass --nats / TRAINGUARD_NATS_URL"
        ) from None
    return nc


async def _close_quietly(nc: NATS) -> None:
    with contextlib.suppress(Exception):
        await nc.close()


class Bus:
    """A connected NATS client plus JetStream, with trainguard's publish conventions."""

    def __init__(self, nc: NATS, subjects: Subjects, *, source: str) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream(timeout=5.0)
        self.subjects = subjects
        self.source = source

    @property
    def connected(self) -> bool:
        return bool(self.nc.is_connected)

    async def publish_durable(
        self,
        subject: str,
        msg: Durable,
        *,
        ctx: Context | None = None,
        timeout: float = 5.0,
    ) -> js_api.PubAck:
        """Publish on JetStream with CloudEvents headers and trace context; await the ack."""
        headers = make_headers(msg, source=self.source, subject=subject)
        tracing.inject(headers, ctx)
        return await self.js.publish(subject, encode_durable(msg), headers=headers,
                                     timeout=timeout)

    async def publish_telemetry(self, subject: str, msg: TelemetryMessage) -> None:
        """Core NATS, fire-and-forget: no headers, no ack, no span."""
        await self.nc.publish(subject, encode_telemetry(msg))

    async def dead_letter(
        self,
        *,
        subject: str,
        payload: bytes,
        reason: str,
        service: str,
        headers: dict[str, str] | None = None,
        deliveries: int = 0,
    ) -> None:
        """Publish a message that could not be processed, with why, to ``<job>.dead``."""
        import time

        job = self.subjects.job_of(subject) or "unknown"
        try:
            dead_subject = self.subjects.dead(job)
        except ValueError:
            dead_subject = self.subjects.dead("unknown")
        letter = DeadLetter(job=job, subject=subject, reason=reason, service=service,
                            payload=payload, headers=dict(headers or {}),
                            deliveries=deliveries, time=time.time())
        await self.publish_durable(dead_subject, letter)

    async def close(self) -> None:
        if self.nc.is_closed:
            return
        try:
            await asyncio.wait_for(self.nc.drain(), 5.0)
        except Exception:
            await _close_quietly(self.nc)
