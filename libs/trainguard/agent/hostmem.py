"""The host's OOM evidence: did the kernel's OOM killer act since the last worker exit?

A worker (or one of its data-loader processes) killed by SIGKILL says nothing of why. The
kernel knows: the memory cgroup counts its OOM kills (cgroup v2 ``memory.events``
``oom_kill``, v1 ``memory.oom_control`` ``oom_kill``) and logs each one (``Out of memory:
Killed process ...``, ``oom-kill:...``) to the kernel log. :class:`OomWatch` reads both
where this process may (the agent's own cgroup holds its workers; ``/dev/kmsg`` is often
closed to containers) and turns what changed since its last look into one line of exit
evidence, ``host OOM evidence: ...``, that the diagnoser's exit-text knowledge reads as
``oom``. Without such a line a data-loader worker killed by a signal stays
``data_pipeline``.
"""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Final

from trainguard.health.kernlog import kmsg_records

log = logging.getLogger("trainguard.agent")

PREFIX: Final = "host OOM evidence: "
NO_OOM: Final = PREFIX + "none"
"""The line for a SIGKILL while the counters were readable and did not move: someone else
sent it (a person, a scheduler, a drill), not the OOM killer."""
KMSG: Final = "/dev/kmsg"
OOM_LINE: Final = re.compile(r"out of memory: kill|oom-kill:|killed process \d+|oom_reaper",
                             re.IGNORECASE)
REPEAT_S: Final = 10.0
"""Evidence found is repeated to exits within this long (several workers of one OOM kill
report one by one; the first look takes what changed)."""
MAX_RECORDS: Final = 10_000
"""Records read from the kernel log per look (a flood must not stall an exit report)."""


def cgroup_files(proc_cgroup: str = "/proc/self/cgroup",
                 root: str = "/sys/fs/cgroup") -> list[str]:
    """The files that count this process's cgroup OOM kills (v2 first, then v1)."""
    found = []
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.lstrip("/")
        if controllers == "":
            found.append(os.path.join(root, rel, "memory.events"))
            found.append(os.path.join(root, "unified", rel, "memory.events"))
        elif "memory" in controllers.split(","):
            found.append(os.path.join(root, "memory", rel, "memory.oom_control"))
    return [p for p in found if os.path.isfile(p)]


def oom_kills(path: str) -> int | None:
    """The ``oom_kill`` counter of a memory.events / memory.oom_control file."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill" and value.strip().isdigit():
                    return int(value)
    except OSError:
        return None
    return None


class OomWatch:
    """What changed in the host's OOM record since the last :meth:`evidence`."""

    def __init__(self, files: list[str] | None = None, kmsg: str | None = KMSG) -> None:
        self.files = cgroup_files() if files is None else files
        self.counts = {p: oom_kills(p) for p in self.files}
        self.last = ("", 0.0)
        self.fd: int | None = None
        if kmsg:
            try:
                self.fd = os.open(kmsg, os.O_RDONLY | os.O_NONBLOCK)
                os.lseek(self.fd, 0, os.SEEK_END)  # only what happens from now on
            except OSError as exc:
                log.debug("kernel log %s not readable (%s): OOM evidence from cgroups only",
                          kmsg, exc)
                self.close()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _kernel_lines(self) -> list[str]:
        if self.fd is None:
            return []
        texts = (r.split(";", 1)[-1].strip() for r in kmsg_records(self.fd, MAX_RECORDS))
        return [t[:200] for t in texts if OOM_LINE.search(t)]

    @property
    def counting(self) -> bool:
        """Whether a cgroup OOM counter can be read (its silence then means something)."""
        return any(oom_kills(p) is not None for p in self.files)

    def evidence(self) -> str:
        """One line when the OOM killer acted since the last call, else ``""``."""
        rises = []
        for path in self.files:
            now, before = oom_kills(path), self.counts.get(path)
            if now is not None and before is not None and now > before:
                rises.append(f"cgroup {os.path.basename(path)} oom_kill {before} -> {now}")
            self.counts[path] = now
        kernel = self._kernel_lines()
        clock = time.monotonic()
        if not rises and not kernel:
            text, at = self.last
            return text if text and clock - at <= REPEAT_S else ""
        text = PREFIX + "; ".join(rises + [f"kernel: {k}" for k in kernel[-3:]])
        self.last = (text, clock)
        return text
