"""How one file's digest is computed, in full or sampled.

Full: XXH3-128 of every byte (the same digest ``xxh128sum`` prints). xxhash releases the
GIL for large buffers, so a thread pool hashes several files at once; reads go into one
reused buffer per thread (``readinto``), so a 100 GB file costs 8 MiB of memory.

Sampled: a data set too large to read in full is still checked for truncation, appended
records and most in-place rewrites by hashing ``blocks`` blocks of ``block_size`` bytes at
evenly spaced offsets (the first block at 0, the last ending at the end of the file),
prefixed with the size. A file no larger than the blocks together is hashed whole (with the
same size prefix), so a small file's sampled digest covers every byte.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Final

import xxhash

CHUNK: Final = 8 * 1024 * 1024
"""Read size. Measured on 2 cores (bench/bench_manifest.py, 64 MiB in memory): 1 MiB chunks
hash at 7.2 GB/s, 8 MiB at 7.7, 16+ MiB at 8.3 on one thread; two threads scale 1.7-1.9x at
every size (the GIL is released). 8 MiB keeps most of the gain at half the memory."""
BLOCK_SIZE: Final = 1024 * 1024
"""Sampled mode's block size."""

_local = threading.local()


def _buffer() -> memoryview:
    buf: memoryview | None = getattr(_local, "buf", None)
    if buf is None:
        buf = memoryview(bytearray(CHUNK))
        _local.buf = buf
    return buf


def _advise_sequential(fd: int) -> None:
    if hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)


def full_digest(path: str | os.PathLike[str]) -> tuple[int, str]:
    """(bytes read, XXH3-128 hex digest) of the whole file."""
    h = xxhash.xxh3_128()
    buf = _buffer()
    total = 0
    with open(path, "rb", buffering=0) as fh:
        _advise_sequential(fh.fileno())
        while n := fh.readinto(buf):
            h.update(buf[:n])
            total += n
    return total, h.hexdigest()


def sample_offsets(size: int, blocks: int, block_size: int = BLOCK_SIZE) -> list[int]:
    """Where the blocks of a sampled digest start; ``[]`` when the file is hashed whole."""
    if blocks < 1:
        raise ValueError(f"sampled hashing needs at least one block, not {blocks}")
    if size <= blocks * block_size:
        return []
    if blocks == 1:
        return [0]
    last = size - block_size
    return [last * i // (blocks - 1) for i in range(blocks)]


def sampled_digest(path: str | os.PathLike[str], blocks: int,
                   block_size: int = BLOCK_SIZE) -> tuple[int, str]:
    """(size, digest of the size and the sampled blocks); see the module's docstring."""
    with open(path, "rb", buffering=0) as fh:
        size = os.fstat(fh.fileno()).st_size
        h = xxhash.xxh3_128(size.to_bytes(8, "little"))
        offsets = sample_offsets(size, blocks, block_size)
        if not offsets:
            buf = _buffer()
            while n := fh.readinto(buf):
                h.update(buf[:n])
        for offset in offsets:
            h.update(os.pread(fh.fileno(), block_size, offset))
    return size, h.hexdigest()


def digest_of(path: str | os.PathLike[str], sample: int | None,
              block_size: int = BLOCK_SIZE) -> tuple[int, str]:
    """The digest a manifest of this mode records for ``path``: (size, hex)."""
    if sample:
        return sampled_digest(path, sample, block_size)
    return full_digest(path)


def canonical_id(mode: str, sample_blocks: int, block_size: int,
                 triples: list[tuple[str, int, str]]) -> str:
    """A manifest's id: XXH3-128 over the mode and the sorted (path, size, digest) lines.
    Modification times stay out: copying the data elsewhere keeps its id."""
    h = xxhash.xxh3_128(f"trainguard-manifest\n{mode} {sample_blocks} {block_size}\n".encode())
    for path, size, digest in sorted(triples):
        h.update(f"{path}\0{size}\0{digest}\n".encode())
    return h.hexdigest()
