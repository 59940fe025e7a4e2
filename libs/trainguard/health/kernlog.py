"""Xid and memory-error lines from the kernel log.

The NVIDIA driver logs every Xid as ``NVRM: Xid (PCI:0000:cb:00): 13, pid=..., ...``;
uncorrectable memory errors appear as Xid 48/63/64/94/95 and, for host DRAM, as EDAC
``UE`` lines. :class:`KernelLog` reads ``/dev/kmsg`` (records ``prio,seq,time,-;text``)
or a plain file of lines (``dmesg`` output, a recording), all that is retained on the
first look and what is new after; :func:`parse_line` is the pure part.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from typing import Final

from trainguard.contract.evidence import KernelLine

XID: Final = re.compile(r"NVRM: Xid \(PCI:([0-9A-Fa-f:.]+)\): (\d+)")
ECC: Final = re.compile(r"\b(DBE|double bit|uncorrectable|ECC error|UE memory)", re.IGNORECASE)
KMSG: Final = re.compile(r"^\d+,\d+,(\d+)[^;]*;")
"""A ``/dev/kmsg`` record's header: priority, sequence, microseconds since boot, flags."""
DMESG: Final = re.compile(r"^\[\s*(\d+\.\d+)\]")
"""``dmesg``'s own stamp, seconds since boot (not ``dmesg -T``'s wall clock)."""
MAX_LINES: Final = 64
"""Lines kept (the newest): a storm of one Xid must not grow a sample without bound."""
MAX_RECORDS: Final = 10_000


def parse_line(raw: str) -> KernelLine | None:
    """A kernel log line about GPU or memory health, else None. The kmsg header and a
    ``[ 123.456]`` stamp become ``since_boot``."""
    since: float | None = None
    header = KMSG.match(raw)
    if header:
        since, text = int(header.group(1)) / 1e6, raw.split(";", 1)[-1]
    else:
        text = raw
    stamp = DMESG.match(text.strip())
    if stamp and since is None:
        since = float(stamp.group(1))
    text = re.sub(r"^\s*\[[^\]]*\]\s*", "", text.strip())
    m = XID.search(text)
    if m:
        return KernelLine(text=text[:300], xid=int(m.group(2)), pci=m.group(1), kind="xid",
                          since_boot=since)
    if ECC.search(text) and ("NVRM" in text or "EDAC" in text):
        return KernelLine(text=text[:300], kind="ecc", since_boot=since)
    return None


def parse(text: str) -> list[KernelLine]:
    return [k for k in map(parse_line, text.splitlines()) if k is not None]


def kmsg_records(fd: int, limit: int = MAX_RECORDS) -> list[str]:
    """The records waiting on a non-blocking ``/dev/kmsg`` descriptor, one line each (its
    ``prio,seq,usec,flags;`` header kept): one ``read`` is one record."""
    out = []
    for _ in range(limit):
        try:
            record = os.read(fd, 8192)
        except BlockingIOError:
            break
        except OSError as exc:
            if exc.errno == errno.EPIPE:  # records overwritten under us: read on
                continue
            break
        if not record:
            break
        out.append(record.decode("utf-8", "replace").splitlines()[0])
    return out


class KernelLog:
    """Reads ``path`` from where it stopped; unreadable (containers often cannot open
    ``/dev/kmsg``), it reads nothing and :attr:`readable` is False."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lines: list[KernelLine] = []
        self._fd: int | None = None
        self._offset = 0
        self._device = False
        self.readable = False
        if not path:
            return
        try:
            self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            self._device = stat.S_ISCHR(os.fstat(self._fd).st_mode)
            self.readable = True
        except OSError:
            self.close()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def read(self) -> list[KernelLine]:
        """The matching lines seen so far (new ones appended), the newest :data:`MAX_LINES`."""
        if self._fd is None:
            return self.lines
        chunks = self._records() if self._device else self._tail()
        for chunk in chunks:
            self.lines.extend(parse(chunk))
        self.lines = self.lines[-MAX_LINES:]
        return self.lines

    def _records(self) -> list[str]:
        assert self._fd is not None
        return kmsg_records(self._fd)

    def _tail(self) -> list[str]:
        assert self._fd is not None
        os.lseek(self._fd, self._offset, os.SEEK_SET)
        data = b""
        while chunk := os.read(self._fd, 1 << 16):
            data += chunk
        self._offset += len(data)
        return [data.decode("utf-8", "replace")]
