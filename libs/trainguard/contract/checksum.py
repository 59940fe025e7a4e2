"""File digests of checkpoint shards: what a rank reports and what the coordinator checks.

The writer (:mod:`trainguard.torch.checkpoint`, on each rank) and the verifier (the
checkpoint coordinator) must compute a file's digest the same way, or every full
verification fails; this is the one place that says how. No torch here: the coordinator
does not install it.
"""

from __future__ import annotations

import os
import zlib
from typing import Final

from .schemas import FileDigest

METADATA_FILE: Final = ".metadata"
"""The DCP file rank 0 writes; a checkpoint without it cannot be loaded."""
CHUNK: Final = 4 * 1024 * 1024
"""Read size: large enough that zlib releases the GIL for most of the work."""


def crc32_of(path: str | os.PathLike[str]) -> int:
    """CRC32 of a file's bytes, streamed (constant memory for any shard size)."""
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def file_digest(path: str | os.PathLike[str]) -> FileDigest:
    """Size and CRC32 of a file, as a rank reports it."""
    return FileDigest(bytes=os.stat(path).st_size, crc32=crc32_of(path))
