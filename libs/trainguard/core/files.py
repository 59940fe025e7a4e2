"""Writing a file so that readers see the old content or the new, never half of either.

The coordinator's ``LATEST`` and ``COMMITTED`` files and the credentials files all go
through :func:`write_atomically`: a temporary file in the same directory (created fresh, so
a symlink planted at the destination is never followed, and with its mode set before any
byte lands), fsync, ``os.replace``, fsync of the directory.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path


def write_atomically(dest: Path, data: bytes, *, mode: int = 0o644) -> Path:
    """Replace ``dest`` with ``data``; ``mode`` is the file's from its first byte."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)  # whatever the umask
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    with contextlib.suppress(OSError):
        dir_fd = os.open(dest.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return dest
