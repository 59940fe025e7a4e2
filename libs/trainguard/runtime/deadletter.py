"""Dead letters that always fit on the bus: the payload whole when small, else its head.

A letter carries the message that could not be processed. Carried whole, one ~1 MB
message (under the streams' 1 MiB limit) made a letter over the server's ``max_payload``
(base64 in JSON is 4/3 of the bytes), the publish failed and the consumer stopped. So
:func:`bounded_letter` sizes the letter to a byte budget (the caller's: ``max_payload``
less the letter's own headers): it keeps the payload whole up to :data:`KEEP_WHOLE`, else
a head, and always records the whole payload's size and SHA-256. Reason and copied headers
are clipped too: they come from the message or its handler and may be just as large.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Final

from trainguard.contract.codec import encode_durable
from trainguard.contract.errors import MessageTooLarge
from trainguard.contract.schemas import DeadLetter

KEEP_WHOLE: Final = 64 * 1024
"""Payloads up to this many bytes travel whole; a larger one keeps a head this long (the
dead-letter stream keeps days of letters: junk should not cost megabytes each)."""
MAX_REASON: Final = 2000
"""Characters of the reason kept (an exception's repr can quote a whole payload)."""
MAX_HEADER_VALUE: Final = 512
MAX_HEADERS: Final = 4096
"""Characters of header names and values copied from the message, all told."""
_CLIP: Final = "…"


def clip(text: str, limit: int) -> str:
    """``text``, cut to ``limit`` characters with a mark where it was cut."""
    return text if len(text) <= limit else text[: max(0, limit - len(_CLIP))] + _CLIP


def bounded_headers(headers: Mapping[str, str], budget: int = MAX_HEADERS) -> dict[str, str]:
    """The message's headers as far as ``budget`` characters go, each value clipped;
    CloudEvents and trace headers first, as the ones an operator reads."""
    ordered = sorted(headers.items(), key=lambda kv: not kv[0].lower().startswith(("ce-",
                                                                                   "trace")))
    kept: dict[str, str] = {}
    for name, value in ordered:
        value = clip(value, MAX_HEADER_VALUE)
        cost = len(name) + len(value)
        if cost > budget:
            continue
        kept[name] = value
        budget -= cost
    return kept


def _base64_fits(room: int) -> int:
    """The most bytes whose base64 (4 characters per 3 bytes, padded) fits ``room``."""
    return max(0, room // 4 * 3)


def bounded_letter(*, job: str, subject: str, reason: str, service: str, payload: bytes,
                   limit: int, consumer: str = "", headers: Mapping[str, str] | None = None,
                   deliveries: int = 0, now: float = 0.0) -> DeadLetter:
    """A letter for ``payload`` whose JSON body is at most ``limit`` bytes.

    Raises :class:`MessageTooLarge` only when not even the letter without payload, headers
    and most of its reason fits (a ``limit`` of a few hundred bytes).
    """
    letter = DeadLetter(job=job, subject=subject, reason=clip(reason, MAX_REASON),
                        service=service, consumer=consumer, size=len(payload),
                        sha256=hashlib.sha256(payload).hexdigest(),
                        headers=bounded_headers(headers or {}), deliveries=deliveries,
                        time=now)
    room = limit - len(encode_durable(letter))
    if room < 0:  # the headers and reason alone are too much: keep what identifies it
        letter.headers, letter.reason = {}, clip(reason, 200)
        room = limit - len(encode_durable(letter))
        if room < 0:
            raise MessageTooLarge(f"dead letter for {subject}", limit - room, limit)
    head = min(_base64_fits(room), KEEP_WHOLE)
    if len(payload) <= head:
        letter.payload = payload
    else:
        letter.payload, letter.truncated = payload[:head], True
    return letter
