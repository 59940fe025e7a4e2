"""Buddy copies: what one rank process sends another's snapshot listener
(:mod:`trainguard.torch.buddy`).

A frame is a 4-byte big-endian length, a MessagePack :class:`BuddyHeader`, its 32-byte
HMAC-SHA256 under the job's buddy key (agreed over the process group, so only the job's
ranks can put or get), then ``nbytes`` bytes of tensor data whose CRC-32 is ``crc``.
"""

from __future__ import annotations

from typing import Literal

import msgspec

BuddyKind = Literal["put", "get", "none"]
"""``put``: a copy follows; ``get``: send back the copy of ``rank`` at ``step`` (-1: the
newest held); ``none``: the answer to a ``get`` when no such copy is held."""


class BuddyHeader(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    kind: BuddyKind
    rank: int
    """Whose state (the sender's rank in the job)."""
    step: int
    """The step the state is after."""
    crc: int = 0
    """CRC-32 of the tensor bytes, as the owner's check computed it on its own copy."""
    names: list[str] = []
    shapes: list[list[int]] = []
    dtypes: list[str] = []
    values: bytes = b""
    """The snapshot's non-tensor values (optimizer groups, RNG, position, extra), pickled:
    trusted only behind the header's HMAC."""
    nbytes: int = 0
