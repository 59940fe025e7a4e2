"""The checkpoint root's write throughput: write a file of a set size, fsync it, time it.

A checkpoint is a burst of large sequential writes that must be on disk before it
commits, so that is what is measured (fsync included: a page cache alone would make any
disk look fast). The file is removed afterwards, whatever happens.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from dataclasses import dataclass

CHUNK = 4 * 1024 * 1024


@dataclass(frozen=True)
class DiskResult:
    mbps: float = 0.0
    megabytes: float = 0.0
    seconds: float = 0.0
    error: str = ""


def write_throughput(root: str, megabytes: float) -> DiskResult:
    """MB/s of writing and fsyncing ``megabytes`` under ``root`` (``error``: why not)."""
    try:  # the ranks' Checkpointer would make it at its first save; so does the check
        os.makedirs(root, exist_ok=True)
    except OSError as exc:
        return DiskResult(error=f"cannot create checkpoint root {root}: {exc.strerror or exc}")
    path = os.path.join(root, f".trainguard-preflight-{uuid.uuid4().hex}")
    total = int(megabytes * 1024 * 1024)
    block = os.urandom(min(CHUNK, total))  # incompressible: no filesystem shortcut
    try:
        start = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            left = total
            while left > 0:
                left -= os.write(fd, block[:left])
            os.fsync(fd)
        finally:
            os.close(fd)
        seconds = time.perf_counter() - start
    except OSError as exc:
        return DiskResult(error=f"cannot write under {root}: {exc.strerror or exc}")
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    mb = total / (1024 * 1024)
    return DiskResult(mbps=round(mb / seconds, 1) if seconds > 0 else 0.0, megabytes=mb,
                      seconds=round(seconds, 3))
