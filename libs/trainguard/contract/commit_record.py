"""``<root>/<job>/step-<S>/COMMITTED``: the coordinator's word that a checkpoint is whole.

The coordinator writes it when it commits a step (every rank's report verified), with the
digests the ranks reported; a rank opens a resume point only where this record matches
(:mod:`trainguard.torch.trusted`). A message on the bus can name a directory, but only the
coordinator, which writes the checkpoint file system, can vouch for one.
"""

from __future__ import annotations

from typing import Final

import msgspec

from .errors import DecodeError
from .schemas import FileDigest, Topology

COMMIT_FILE: Final = "COMMITTED"


class CommitRecord(msgspec.Struct, kw_only=True):
    job: str
    step: int
    path: str
    checkpoint_id: str = ""
    world_size: int = 0
    files: dict[str, FileDigest] = {}
    """File name -> digest, merged from every rank's report."""
    time: float = 0.0
    topology: Topology | None = None
    """How the saving job laid its state out, as its ranks reported it."""
    base: int | None = None
    """An increment's base step (None: a full checkpoint): a restore reads the base too."""
    base_id: str = ""
    """The base's checkpoint id when this was committed: a rank refuses a base whose own
    commit record names another (the step saved again since)."""


_decoder = msgspec.json.Decoder(CommitRecord)


def encode_commit(record: CommitRecord) -> bytes:
    return msgspec.json.encode(record)


def decode_commit(data: bytes) -> CommitRecord:
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise DecodeError(f"invalid commit record: {exc}") from None
