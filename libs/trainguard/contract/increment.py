"""``step-<S>/INCREMENT``: what an incremental checkpoint did not write, and where it lies.

An incremental save writes only the tensors whose bytes differ from the last full save
(its *base*); this file, written by group rank 0 beside DCP's ``.metadata`` and reported
with its files (so the coordinator verifies it and the commit record covers it), names the
base and, for each tensor not written, the checkpoint that holds it. A checkpoint without
it is full. A restore reads at most two checkpoints: the increment and its base.
"""

from __future__ import annotations

from typing import Final

import msgspec

from .errors import DecodeError

INCREMENT_FILE: Final = "INCREMENT"


class Increment(msgspec.Struct, kw_only=True):
    base: int
    """The step of the full checkpoint this one builds on (a sibling ``step-<base>``)."""
    held: dict[str, int] = {}
    """Tensor key (its state-dict path, dot-joined) -> the step whose checkpoint holds it."""


_decoder = msgspec.json.Decoder(Increment)


def encode_increment(increment: Increment) -> bytes:
    return msgspec.json.encode(increment)


def decode_increment(data: bytes) -> Increment:
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise DecodeError(f"invalid increment record: {exc}") from None
