"""The host probe: what besides its GPU counters can make a node's rank straggle.

The agent calls :meth:`HostProbe.facts` with each GPU sample it publishes
(``GpuSample.facts``), so the diagnoser's straggler checklist reads the same telemetry
path it already reads GPU throttling from: InfiniBand/RoCE ports, CPU steal and load,
the kernel log's Xid and ECC lines, and compute processes on the GPUs that are none of
the job's. Every source is a setting (sysfs, procfs, kernel log roots), so recorded
readings stand in.
"""

from __future__ import annotations

import os

from trainguard.contract.evidence import ForeignProcess, HostFacts
from trainguard.contract.schemas import GpuStats

from . import sysfs
from .kernlog import KernelLog
from .procfs import CpuSampler, process_name, uptime
from .settings import PreflightSettings

ANCESTRY = 8
"""Parents walked up from a GPU process to find one of the job's ranks (a rank's own
children, such as a compile worker, belong to the job)."""


def parent(proc_root: str, pid: int) -> int | None:
    try:
        with open(os.path.join(proc_root, str(pid), "stat")) as f:
            text = f.read()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[-1].split()
    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None


def foreign_processes(gpus: list[GpuStats], own: set[int],
                      proc_root: str) -> list[ForeignProcess]:
    """The GPUs' compute processes that are neither one of ``own`` nor below one."""
    found = []
    for g in gpus:
        for pid in g.processes:
            walk: int | None = pid
            ours = False
            for _ in range(ANCESTRY):
                if walk is None or walk <= 1:
                    break
                if walk in own:
                    ours = True
                    break
                walk = parent(proc_root, walk)
            if not ours:
                name, uid = process_name(proc_root, pid)
                found.append(ForeignProcess(gpu=g.index, pid=pid, name=name, user=uid))
    return found


class HostProbe:
    """Keeps what needs two looks (CPU ticks) or a position (the kernel log) between
    calls; cheap enough to run with every GPU sample."""

    def __init__(self, settings: PreflightSettings) -> None:
        self.settings = settings
        self.kernel = KernelLog(settings.kernel_log)
        self.cpu = CpuSampler(settings.proc_root)

    def facts(self, gpus: list[GpuStats], own: set[int]) -> HostFacts:
        s = self.settings
        return HostFacts(ib_ports=sysfs.ib_ports(s.sysfs_root),
                         ib_expected_gbps=s.preflight_ib_rate_gbps,
                         cpu=self.cpu.sample(), kernel=list(self.kernel.read()),
                         uptime_s=uptime(s.proc_root),
                         foreign=foreign_processes(gpus, own, s.proc_root))

    def close(self) -> None:
        self.kernel.close()
