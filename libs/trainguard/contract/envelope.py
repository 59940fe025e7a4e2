"""CloudEvents binary-mode envelope in NATS headers, and message ids.

Every durable publish gets a fresh ``ce-id`` (a uuid7: unique, and sortable by time) that
is also its ``Nats-Msg-Id``, so JetStream dedupes a publisher's retries but never an
entity's later revision, which is a new message with the same entity id in the body.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Final

from .schemas import Durable

SPEC_VERSION: Final = "1.0"
H_ID: Final = "ce-id"
H_TYPE: Final = "ce-type"
H_SOURCE: Final = "ce-source"
H_SUBJECT: Final = "ce-subject"
H_TIME: Final = "ce-time"
H_SPEC: Final = "ce-specversion"
H_MSG_ID: Final = "Nats-Msg-Id"
H_TRACEPARENT: Final = "traceparent"
H_TRACESTATE: Final = "tracestate"

_CANONICAL = {h.lower(): h for h in (H_ID, H_TYPE, H_SOURCE, H_SUBJECT, H_TIME, H_SPEC,
                                     H_MSG_ID, H_TRACEPARENT, H_TRACESTATE)}


def uuid7() -> str:
    """An RFC 9562 version-7 UUID: 48 bits of Unix milliseconds, then randomness."""
    ms = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    value = (ms & ((1 << 48) - 1)) << 80 | rand & ((1 << 80) - 1)
    value = (value & ~(0xF << 76)) | (0x7 << 76)  # version 7
    value = (value & ~(0x3 << 62)) | (0x2 << 62)  # RFC 4122 variant
    return str(uuid.UUID(int=value))


def normalize_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    """Header names as trainguard spells them, whatever case a peer used.

    nats-py hands headers over as a plain, case-sensitive dict: normalising in one place
    keeps every lookup below simple.
    """
    if not headers:
        return {}
    return {_CANONICAL.get(k.lower(), k): v for k, v in headers.items()}


def make_headers(msg: Durable, *, source: str, subject: str) -> dict[str, str]:
    """A fresh header dict for one publish (``js.publish`` mutates the dict it gets)."""
    ce_id = uuid7()
    return {
        H_SPEC: SPEC_VERSION,
        H_ID: ce_id,
        H_MSG_ID: ce_id,
        H_TYPE: msg.ce_type(),
        H_SOURCE: source,
        H_SUBJECT: subject,
        H_TIME: datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
    }
