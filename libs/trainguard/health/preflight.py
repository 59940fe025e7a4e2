"""Run a node's pre-flight: the checks the settings name, each timed, into one record.

The caller brings the GPU reading (the agent's NVML source, or a recorded dump) and the
pids that are the job's own, so the same run serves ``trainguard launch`` (before its
ranks start: no process may be on the GPUs), a ``preflight`` command (its ranks running)
and ``trainguard preflight``. A check that raises is a ``warn`` naming the error: a bug
in a check must not keep every node out of every job.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Literal

from trainguard.contract.envelope import uuid7
from trainguard.contract.schemas import GpuStats, PreflightCheck, PreflightReport

from . import bandwidth, checks, dcgm, disk, procfs, sysfs
from .kernlog import KernelLog
from .probe import foreign_processes
from .settings import PreflightSettings

Trigger = Literal["launch", "command", "cli"]


def _nvml(s: PreflightSettings, gpus: list[GpuStats] | None, gpu_why: str,
          own: set[int]) -> list[PreflightCheck]:
    if gpus is None:
        return [checks.result("nvml", "skipped", gpu_why or "no GPU reading")]
    log = KernelLog(s.kernel_log)
    try:
        lines = log.read()
    finally:
        log.close()
    # The job's own: its ranks and what they started (the probe's walk up the parents).
    foreign = {f.pid for f in foreign_processes(gpus, own, s.proc_root)}
    ours = {pid for g in gpus for pid in g.processes if pid not in foreign}
    return [*checks.nvml(gpus, ours),
            checks.kernel_log(lines, log.readable, procfs.uptime(s.proc_root))]


def _dcgm(s: PreflightSettings) -> list[PreflightCheck]:
    if s.preflight_dcgm_level == 0:
        return [checks.result("dcgm", "skipped", "preflight_dcgm_level is 0")]
    run = dcgm.run(s.preflight_dcgm_level, s.preflight_timeout_s)
    if run.missing:
        return [checks.result("dcgm", "skipped", run.missing)]
    if run.error:
        return [checks.result(f"dcgm.diag-r{s.preflight_dcgm_level}", "warn", run.error)]
    return [checks.dcgm(dcgm.parse(run.output), s.preflight_dcgm_level)]


def _allreduce(s: PreflightSettings, count: int) -> list[PreflightCheck]:
    r = bandwidth.measure(gpus=count, procs=s.preflight_allreduce_procs,
                          megabytes=s.preflight_allreduce_mb, iters=s.preflight_allreduce_iters,
                          timeout=s.preflight_timeout_s)
    floor = s.preflight_nccl_floor_gbps if count else s.preflight_gloo_floor_gbps
    return [checks.bandwidth(r, floor)]


def _disk(s: PreflightSettings) -> list[PreflightCheck]:
    if not s.checkpoint_root:
        return [checks.disk(None, s.preflight_disk_floor_mbps)]
    # In a thread of its own: a write to a stuck network mount never returns, and the
    # node's start must not wait for it (the thread is left to the mount).
    done: list[disk.DiskResult] = []
    worker = threading.Thread(target=lambda: done.append(disk.write_throughput(
        s.checkpoint_root, s.preflight_disk_mb)), name="preflight-disk", daemon=True)
    worker.start()
    worker.join(s.preflight_timeout_s)
    r = done[0] if done else disk.DiskResult(
        error=f"no answer from {s.checkpoint_root} within {s.preflight_timeout_s:g} s")
    return [checks.disk(r, s.preflight_disk_floor_mbps)]


def run(s: PreflightSettings, *, job: str, host: str, gpus: list[GpuStats] | None,
        gpu_why: str = "", own: set[int] | None = None, trigger: Trigger = "cli",
        only: list[str] | None = None, devices: int | None = None) -> PreflightReport:
    """Run the checks of ``only`` (default: the settings'), in :data:`.settings.CHECKS`
    order; ``own``: pids that may use the GPUs (the job's ranks); ``devices``: the GPUs
    the bandwidth test may use (default: those of the reading; a drill's scripted GPUs
    are none)."""
    steps: dict[str, Callable[[], list[PreflightCheck]]] = {
        "nvml": lambda: _nvml(s, gpus, gpu_why, own or set()),
        "dcgm": lambda: _dcgm(s),
        "ib": lambda: checks.ib(sysfs.ib_ports(s.sysfs_root), s.preflight_ib_rate_gbps),
        "allreduce": lambda: _allreduce(s, len(gpus or []) if devices is None else devices),
        "disk": lambda: _disk(s),
    }
    wanted = only if only is not None else s.checks()
    start = time.monotonic()
    found: list[PreflightCheck] = []
    for name, step in steps.items():
        if name not in wanted:
            continue
        t0 = time.monotonic()
        try:
            got = step()
        except Exception as exc:
            got = [checks.result(name, "warn", f"the check raised {type(exc).__name__}: {exc}")]
        spent = round(time.monotonic() - t0, 3)
        for c in got:
            c.seconds = spent
        found += got
    status = checks.overall(found)
    return PreflightReport(id=uuid7(), job=job, host=host, status=status,
                           checks=found, trigger=trigger,
                           seconds=round(time.monotonic() - start, 3), time=time.time())


def render(report: PreflightReport) -> str:
    """The record as lines for a terminal."""
    lines = [f"preflight {report.host}: {report.status.upper()} ({report.seconds:g} s)"]
    for c in report.checks:
        detail = c.reason or (f"{c.value}" if c.value not in (None, [], {}) else "")
        lines.append(f"  {c.status:<7} {c.name:<28} {detail}")
    return "\n".join(lines)
