"""The services' NATS connection, and the publish helpers.

The connection reconnects forever with the options of :mod:`trainguard.core.connection` (shared
with the trainer client), so the *first* connect has to be bounded by hand: with endless
reconnects ``nats.connect`` to a dead URL never returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js import errors as js_errors
from opentelemetry.context import Context

from trainguard.contract.codec import (
    MAX_DURABLE_BYTES,
    check_wire_size,
    encode_durable,
    encode_telemetry,
    header_size,
)
from trainguard.contract.envelope import make_headers
from trainguard.contract.errors import TrainguardError
from trainguard.contract.schemas import DeadLetter, Durable, TelemetryMessage
from trainguard.contract.subjects import Subjects
from trainguard.core import tracing
from trainguard.core.connection import ErrorCallback, EventCallback, connect_options

from .deadletter import bounded_letter

if TYPE_CHECKING:
    from .config import Settings

log = logging.getLogger("trainguard.runtime.bus")


UNACKED_PUBLISH_ERRORS: tuple[type[BaseException], ...] = (
    nats.errors.NoRespondersError, nats.errors.TimeoutError, TimeoutError,
    nats.errors.ConnectionReconnectingError, nats.errors.OutboundBufferLimitError,
    js_errors.NoStreamResponseError, js_errors.ServiceUnavailableError,
)
"""A JetStream publish that got no ack: the stream's leader is being elected (a NATS node
lost) or the client is reconnecting. Worth a retry with the same message id."""


class BusUnavailable(TrainguardError, ConnectionError):
    """The first connect to NATS did not succeed within its bound."""


async def connect_as(settings: Settings, creds: str | os.PathLike[str], name: str) -> NATS:
    """A connection to ``settings``' server (its TLS too) as the control-plane identity
    whose ``.creds`` file is ``creds`` (jwt mode: the issuer, the system account's user)."""
    access = settings.replace(nats_creds=str(creds), credentials="").access.nats_options()
    return await connect_nats(settings.nats_url, name=name, timeout=settings.connect_timeout,
                              access=access)


async def connect_nats(
    url: str,
    *,
    name: str,
    timeout: float = 5.0,
    error_cb: ErrorCallback | None = None,
    disconnected_cb: EventCallback | None = None,
    reconnected_cb: EventCallback | None = None,
    pending_size: int | None = None,
    access: Mapping[str, Any] | None = None,
) -> NATS:
    """Connect within ``timeout`` seconds, or :class:`BusUnavailable` saying what to do.

    ``access``: credentials and TLS options (:meth:`trainguard.core.auth.Access.nats_options`).
    """

    errors: list[Exception] = []

    async def _on_error(exc: Exception) -> None:
        if len(errors) < 8:
            errors.append(exc)  # an auth refusal arrives here while connect retries
        if error_cb is not None:
            await error_cb(exc)
        else:
            log.debug("nats error: %r", exc)

    options = connect_options(url, name=name, connect_timeout=min(2.0, timeout),
                              error_cb=_on_error, disconnected_cb=disconnected_cb,
                              reconnected_cb=reconnected_cb, pending_size=pending_size)
    options.update(access or {})
    nc = NATS()
    try:
        await asyncio.wait_for(nc.connect(**options), timeout)
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        await _close_quietly(nc)
        refused = next((e for e in (exc, *errors) if "authorization" in str(e).lower()), None)
        if refused is not None:
            raise BusUnavailable(
                f"NATS at {url} refused this client ({refused}); give the role's credentials "
                "with TRAINGUARD_CREDENTIALS (see `trainguard credentials`)") from None
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

    @property
    def max_payload(self) -> int:
        """The most bytes (body and headers) one publish may take: the server's
        ``max_payload`` from its INFO once connected, never above the durable limit."""
        return min(int(self.nc.max_payload or MAX_DURABLE_BYTES), MAX_DURABLE_BYTES)

    def _headers(self, subject: str, msg: Durable, ctx: Context | None) -> dict[str, str]:
        headers = make_headers(msg, source=self.source, subject=subject)
        tracing.inject(headers, ctx)
        return headers

    async def _publish(self, subject: str, kind: str, body: bytes, headers: dict[str, str],
                       timeout: float) -> js_api.PubAck:
        # Refused here, with its size: nats-py checks only the body, and a server that gets
        # more than its max_payload drops the whole connection.
        check_wire_size(f"{kind} on {subject}", body, headers, self.max_payload)
        return await self.js.publish(subject, body, headers=headers, timeout=timeout)

    async def publish_durable(
        self,
        subject: str,
        msg: Durable,
        *,
        ctx: Context | None = None,
        timeout: float = 5.0,
        retry_for: float = 0.0,
    ) -> js_api.PubAck:
        """Publish on JetStream with CloudEvents headers and trace context; await the ack.

        ``retry_for``: seconds to go on retrying a publish that got no ack
        (:data:`UNACKED_PUBLISH_ERRORS`), backing off from 0.1 s to 1 s. Each retry has the
        same ``Nats-Msg-Id``, so one that did land before its ack was lost is deduped.
        Raises :class:`~trainguard.contract.errors.MessageTooLarge` (nothing sent) for a message
        the server or the streams would not take.
        """
        body, headers = encode_durable(msg), self._headers(subject, msg, ctx)
        deadline, pause = time.monotonic() + retry_for, 0.1
        while True:
            try:
                return await self._publish(subject, msg.KIND, body, headers, timeout)
            except UNACKED_PUBLISH_ERRORS as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                log.warning("publish of %s on %s got no ack (%r); retrying", msg.KIND,
                            subject, exc)
                await asyncio.sleep(min(pause, left))
                pause = min(1.0, pause * 2)

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
        consumer: str = "",
        headers: dict[str, str] | None = None,
        deliveries: int = 0,
    ) -> None:
        """Publish a message that could not be processed, with why, to ``<job>.dead``.

        The letter fits the server whatever the message's size (:mod:`.deadletter`); what
        can still fail is the publish itself (NATS down, no dead-letter stream).
        """
        job = self.subjects.job_of(subject) or "unknown"
        try:
            dead_subject = self.subjects.dead(job)
        except ValueError:
            dead_subject = self.subjects.dead("unknown")
        # The letter's own headers do not depend on its body: size them first.
        out_headers = self._headers(dead_subject, DeadLetter(job=job, subject=subject,
                                                             reason=""), None)
        letter = bounded_letter(job=job, subject=subject, reason=reason, service=service,
                                consumer=consumer, payload=payload, headers=headers,
                                deliveries=deliveries, now=time.time(),
                                limit=self.max_payload - header_size(out_headers))
        await self._publish(dead_subject, DeadLetter.KIND, encode_durable(letter),
                            out_headers, 5.0)

    async def close(self) -> None:
        if self.nc.is_closed:
            return
        try:
            await asyncio.wait_for(self.nc.drain(), 5.0)
        except Exception:
            await _close_quietly(self.nc)
