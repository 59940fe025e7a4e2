"""Whether a rank's process is doing anything: what tells a stuck data loader from a
refilling one.

A rank held in ``data`` looks the same to its peers whether its loader is refilling
(workers decoding, bytes arriving from storage) or stuck (a worker deadlocked, a mount
gone): the heartbeat only says where it is. What differs is work. While a phase lasts,
the transport thread looks at the process's CPU time and bytes read and written, less
trainguard's own threads (they beat, send and snapshot whatever the trainer does), and at
each child process's (the loader's workers). A refill shows CPU or I/O, also one that
trickles from remote storage; a stuck loader shows neither, and the heartbeat says for
how long (``Heartbeat.quiet_for``), so the detector can judge it by the fast floor.

Linux only (``/proc``); elsewhere nothing is ever reported quiet, which keeps the slow
floor.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

OWN_THREADS = "trainguard"
"""Threads whose names start with this are trainguard's, never the trainer's work."""
LOOK_EVERY_S = 0.25
"""At most one look per this long: a look reads a few files per thread and child."""
BUSY_CPU_SHARE = 0.05
"""CPU time above this share of the time between two looks is work (a blocked thread's
wake-ups and the clock's 10 ms ticks stay well below it)."""

@dataclass(frozen=True)
class Reading:
    work: dict[str, tuple[float, int]]
    """CPU seconds and bytes read and written so far, by source: ``self`` (the process less
    trainguard's threads) and each child's pid."""
    in_io: bool = False
    """A thread of the trainer's or a child is in uninterruptible sleep (``D``): a read in
    flight, whose bytes count only once it returns. Slow storage, not known to be stuck."""


def _io_bytes(path: str) -> int:
    with open(path, "rb") as f:
        fields = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
    return int(fields[b"rchar"]) + int(fields[b"wchar"])


def _stat(path: str) -> tuple[bytes, float]:
    """State letter and CPU seconds (utime + stime) of ``/proc/.../stat``."""
    with open(path, "rb") as f:
        stat = f.read()
    fields = stat[stat.rindex(b")") + 2:].split()  # the name may hold spaces
    return fields[0], (int(fields[11]) + int(fields[12])) / _TICKS


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _tasks(own: set[int]) -> tuple[set[str], bool]:
    """The children of every thread of this process, and whether one of the trainer's
    threads (not in ``own``) is in ``D``."""
    pids: set[str] = set()
    in_io = False
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children", "rb") as f:
                pids.update(p.decode() for p in f.read().split())
            if int(tid) not in own:
                in_io = in_io or _stat(f"/proc/self/task/{tid}/stat")[0] == b"D"
        except OSError:
            continue  # the thread ended
    return pids, in_io


def read() -> Reading | None:
    """This process's and its children's work so far; None where it cannot be read."""
    try:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu = usage.ru_utime + usage.ru_stime
        io = _io_bytes("/proc/self/io")
        own: set[int] = set()
        for t in threading.enumerate():
            if not t.name.startswith(OWN_THREADS) or t.ident is None or t.native_id is None:
                continue
            try:
                cpu -= time.clock_gettime(time.pthread_getcpuclockid(t.ident))
                io -= _io_bytes(f"/proc/self/task/{t.native_id}/io")
                own.add(t.native_id)
            except (OSError, ProcessLookupError):
                continue  # it ended between the listing and the read
        work = {"self": (cpu, io)}
        children, in_io = _tasks(own)
        for pid in children:
            try:
                state, child_cpu = _stat(f"/proc/{pid}/stat")
                work[pid] = (child_cpu, _io_bytes(f"/proc/{pid}/io"))
                in_io = in_io or state == b"D"
            except (OSError, ValueError, IndexError):
                continue  # it ended, or is not ours to read
        return Reading(work, in_io)
    except (OSError, AttributeError, ValueError):
        return None


def busy(before: Reading, after: Reading, seconds: float) -> bool:
    """Did anything work between the two readings? A new child is work (a loader starting
    its workers); a child gone is not (its absence says nothing of the rest); a read in
    flight is."""
    if after.in_io:
        return True
    cpu = 0.0
    for source, (c, b) in after.work.items():
        if source not in before.work:
            return True
        c0, b0 = before.work[source]
        if b > b0:
            return True
        cpu += max(0.0, c - c0)
    return cpu > BUSY_CPU_SHARE * seconds


class Activity:
    """How long the current phase has shown no work, from looks on the transport thread.

    ``phase_key`` names one phase instance (its start time): a new one starts over. The
    first look only takes a reading, so a phase counts as quiet from its first look, never
    from before it."""

    __slots__ = ("_key", "_last", "_quiet_since", "_read", "beat_sent", "quiet")

    def __init__(self, reader: Callable[[], Reading | None] = read) -> None:
        self._read = reader
        self._key: float | None = None
        self._last: tuple[float, Reading] | None = None
        self._quiet_since: float | None = None
        self.beat_sent = False
        """The quiet heartbeat of this phase instance went already."""
        self.quiet = 0.0
        """Seconds quiet as of the last look."""

    def look(self, phase_key: float | None, now: float) -> float:
        """Seconds the phase has been quiet as of ``now`` (0: working, or not known)."""
        if phase_key is None:
            self._reset(None)
            return 0.0
        if phase_key != self._key:
            self._reset(phase_key)
        if self._last is not None and now - self._last[0] < LOOK_EVERY_S:
            return self.quiet
        reading = self._read()
        if reading is None:
            self._reset(phase_key)
            return 0.0
        if self._last is None or busy(self._last[1], reading, now - self._last[0]):
            self._quiet_since = now
        self._last = (now, reading)
        self.quiet = now - self._quiet_since if self._quiet_since is not None else 0.0
        return self.quiet

    def said(self, phase_key: float | None) -> float:
        """What a heartbeat says now: the last look's quiet, if it was of this phase (a
        beat between a phase's start and the next look must not carry the last one's)."""
        return self.quiet if phase_key is not None and phase_key == self._key else 0.0

    def _reset(self, key: float | None) -> None:
        self._key, self._last, self._quiet_since = key, None, None
        self.beat_sent = False
        self.quiet = 0.0
