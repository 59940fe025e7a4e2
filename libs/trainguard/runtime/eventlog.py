"""Reading the event history (``TG_EVENTS``) to its end, then, if asked, following it.

On-call tools (``trainguard events``, ``trainguard incidents show``, the dashboard) read
with an ordered consumer, which the server pushes into the client's buffer. "The end of the
history" must therefore come from the server's counts, never from the consumer's
``num_pending`` (zero as soon as everything sits in the client buffer, which made
``trainguard events`` print 1 of 6 events): before reading, the stream says how many
messages match the filter (``stream_info(subjects_filter=...)``), and each delivered
message's metadata says how many matching ones were still pending on the server after it.
The history ends at the message whose pending count is zero.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from nats.aio.msg import Msg
from nats.js import JetStreamContext

from trainguard.contract.codec import decode_any_durable
from trainguard.contract.envelope import H_TIME, H_TYPE, normalize_headers
from trainguard.contract.errors import DecodeError
from trainguard.contract.schemas import Durable
from trainguard.contract.subjects import stream_name

FOLLOW_POLL = 1.0
STALL_TIMEOUT = 15.0
"""Reading history, the longest wait for the next message the server still owes us before
giving up (a stream purged under the reader): generous, a busy machine is slow."""


@dataclass(frozen=True)
class Event:
    """One message of the event stream: where it came from and what it decodes to."""

    subject: str
    ce_type: str
    time: str
    """``ce-time`` (RFC 3339), as the publisher wrote it."""
    data: bytes
    sequence: int
    event: Durable | None
    error: str = ""
    """Why ``event`` is None (the body did not decode against its ``ce-type``)."""


def _event(msg: Msg) -> Event:
    headers = normalize_headers(msg.headers)
    ce_type = headers.get(H_TYPE, "")
    try:
        event: Durable | None = decode_any_durable(msg.data, ce_type or None)
        error = ""
    except DecodeError as exc:
        event, error = None, str(exc)
    return Event(subject=msg.subject, ce_type=ce_type, time=headers.get(H_TIME, ""),
                 data=msg.data, sequence=msg.metadata.sequence.stream, event=event,
                 error=error)


async def matching(js: JetStreamContext, prefix: str, subject: str) -> int:
    """How many messages of the event stream match ``subject`` now (server-side count)."""
    info = await js.stream_info(stream_name(prefix, "events"), subjects_filter=subject)
    return sum((info.state.subjects or {}).values())


async def read(js: JetStreamContext, prefix: str, subject: str, *,
               follow: bool = False, stall: float = STALL_TIMEOUT,
               stop: asyncio.Event | None = None) -> AsyncIterator[Event]:
    """Every event matching ``subject`` from the start of the history, in stream order.

    Without ``follow`` the iterator ends with the last message that matched when the
    server delivered it; with ``follow`` it goes on with new events until ``stop`` is set
    (checked every second) or it is cancelled. A long-running reader should stop by
    ``stop``: Python 3.11's ``asyncio.wait_for`` (inside nats-py's ``next_msg``) loses a
    cancel that lands as a message arrives, and the reader would go on.
    """
    if not follow and await matching(js, prefix, subject) == 0:
        return
    sub = await js.subscribe(subject, ordered_consumer=True,
                             stream=stream_name(prefix, "events"))
    try:
        while not (stop is not None and stop.is_set()):
            try:
                msg = await sub.next_msg(timeout=stall if not follow else FOLLOW_POLL)
            except TimeoutError:
                if follow:
                    continue
                return
            yield _event(msg)
            if not follow and msg.metadata.num_pending == 0:
                return
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


def latest(events: list[Event]) -> dict[str, Durable]:
    """The newest revision of each entity among ``events`` (by ``id``; later wins)."""
    out: dict[str, Durable] = {}
    for e in events:
        ident: Any = getattr(e.event, "id", None)
        if e.event is not None and isinstance(ident, str):
            out[ident] = e.event
    return out
