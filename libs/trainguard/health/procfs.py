"""CPU time and load from procfs: ``/proc/stat``'s first line and ``/proc/loadavg``.

``/proc/stat``'s ``cpu`` line holds cumulative ticks (user nice system idle iowait irq
softirq steal guest guest_nice, ``man 5 proc``): a share needs two looks, so
:class:`CpuSampler` keeps the last one. The root is a setting, so recorded files stand in.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from trainguard.contract.evidence import CpuLoad


@dataclass(frozen=True)
class CpuTimes:
    total: int
    idle: int
    """idle + iowait."""
    steal: int
    cpus: int
    at: float


def _lines(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().splitlines()
    except OSError:
        return []


def cpu_times(proc_root: str, now: float | None = None) -> CpuTimes | None:
    """The ``cpu`` line of ``<proc_root>/stat`` (None: unreadable). Guest time is already
    inside user and nice, so it is not counted twice."""
    lines = _lines(os.path.join(proc_root, "stat"))
    head = next((ln for ln in lines if ln.startswith("cpu ")), None)
    if head is None:
        return None
    ticks = [int(v) for v in head.split()[1:] if v.isdigit()]
    ticks += [0] * (8 - len(ticks))
    cpus = sum(1 for ln in lines if ln.startswith("cpu") and ln[3:4].isdigit())
    return CpuTimes(total=sum(ticks[:8]), idle=ticks[3] + ticks[4], steal=ticks[7],
                    cpus=cpus or 1, at=time.monotonic() if now is None else now)


def uptime(proc_root: str) -> float | None:
    """``<proc_root>/uptime``: seconds since boot (what kernel log stamps count from)."""
    lines = _lines(os.path.join(proc_root, "uptime"))
    try:
        return float(lines[0].split()[0]) if lines else None
    except (IndexError, ValueError):
        return None


def loadavg(proc_root: str) -> tuple[float, int] | None:
    """``<proc_root>/loadavg``: the 1-minute load and the runnable tasks now."""
    lines = _lines(os.path.join(proc_root, "loadavg"))
    if not lines:
        return None
    parts = lines[0].split()
    try:
        return float(parts[0]), int(parts[3].split("/")[0])
    except (IndexError, ValueError):
        return None


def between(before: CpuTimes | None, after: CpuTimes | None,
            load: tuple[float, int] | None) -> CpuLoad:
    """The CPUs' shares between two looks; without an earlier look, since boot (the
    counters start at 0; ``window_s`` 0 says so). None where no tick passed."""
    steal = busy = None
    window = 0.0
    if after is not None and before is None:
        before = CpuTimes(total=0, idle=0, steal=0, cpus=after.cpus, at=after.at)
    if before is not None and after is not None and after.total > before.total:
        span = after.total - before.total
        steal = round(100.0 * (after.steal - before.steal) / span, 2)
        busy = round(100.0 * (span - (after.idle - before.idle)) / span, 2)
        window = round(after.at - before.at, 3)
    cpus = after.cpus if after is not None else 0
    return CpuLoad(steal_pct=steal, busy_pct=busy, load1=load[0] if load else None,
                   runnable=load[1] if load else None, cpus=cpus, window_s=window)


class CpuSampler:
    """The CPUs since the previous :meth:`sample` (the first one: since boot, unless
    ``baseline`` gives an earlier reading). A look that saw no tick pass keeps the last
    shares."""

    def __init__(self, proc_root: str, baseline: CpuTimes | None = None) -> None:
        self.proc_root = proc_root
        self.last = baseline
        self.shown: CpuLoad | None = None

    def sample(self) -> CpuLoad:
        now = cpu_times(self.proc_root)
        load = between(self.last, now, loadavg(self.proc_root))
        if load.steal_pct is None and self.shown is not None:
            load.steal_pct, load.busy_pct = self.shown.steal_pct, self.shown.busy_pct
            load.window_s = self.shown.window_s
        if now is not None and (self.last is None or now.total > self.last.total):
            self.last = now
        self.shown = load
        return load


def process_name(proc_root: str, pid: int) -> tuple[str, str]:
    """A process's command name and owner uid (empty where unreadable)."""
    comm = _lines(os.path.join(proc_root, str(pid), "comm"))
    uid = ""
    for ln in _lines(os.path.join(proc_root, str(pid), "status")):
        if ln.startswith("Uid:"):
            uid = ln.split()[1] if len(ln.split()) > 1 else ""
            break
    return (comm[0] if comm else ""), uid
