"""Every pre-flight check as a pure function over a reading, and the straggler checklist's
verdicts that share them.

A check returns :class:`~trainguard.contract.schemas.PreflightCheck` records: ``fail``
keeps the node out of the job (the remediator's policy blocklists it), ``warn`` is said
and let through, ``skipped`` says why it could not look. What fails and what warns:

* NVML, per GPU: uncorrectable ECC since the driver loaded (aggregate only: warn), rows
  waiting to be remapped or pages to be retired (a reset is due), a failed remap, a
  hardware slowdown, thermal or power-brake clock reason (software thermal or power cap:
  warn), a PCIe link narrower than its maximum (a slower generation only warns, and only
  on a busy GPU: idle GPUs lower it to save power), a compute process that is not the
  job's, and, from the kernel log, a fatal Xid (others warn);
* ``dcgmi diag``: any test that fails (warns: warn);
* InfiniBand/RoCE: a port not ``ACTIVE``/``LinkUp``, or slower than expected (the setting,
  else the best of the node's ports of its link layer: one port at 100 Gb/sec among
  200 Gb/sec ones is a degraded cable or transceiver);
* the all-reduce bus bandwidth and the checkpoint root's write throughput below floors.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any, Final, Literal

from trainguard.contract.evidence import CpuLoad, IbPort, KernelLine
from trainguard.contract.schemas import CheckStatus, GpuStats, PreflightCheck
from trainguard.runtime import xids

from .bandwidth import BandwidthResult
from .dcgm import DiagTest
from .disk import DiskResult

HARD_THROTTLE: Final = frozenset({"hw_slowdown", "hw_thermal_slowdown",
                                  "hw_power_brake_slowdown"})
SOFT_THROTTLE: Final = frozenset({"sw_thermal_slowdown", "sw_power_cap"})
LINK_UP: Final = ("ACTIVE", "LinkUp")
ORDER: Final[dict[str, int]] = {"ok": 0, "skipped": 0, "warn": 1, "fail": 2}


def result(name: str, status: CheckStatus, reason: str = "", value: Any = None,
           threshold: Any = None) -> PreflightCheck:
    return PreflightCheck(name=name, status=status, value=value, threshold=threshold,
                          reason=reason)


def overall(checks: Iterable[PreflightCheck]) -> Literal["ok", "warn", "fail"]:
    """``fail`` if any check failed, else ``warn`` if any warned, else ``ok``."""
    worst = max((ORDER[c.status] for c in checks), default=0)
    return "fail" if worst == 2 else "warn" if worst == 1 else "ok"


# -- NVML -------------------------------------------------------------------------------


def ecc(g: GpuStats) -> PreflightCheck:
    name = f"nvml.ecc:gpu{g.index}"
    vol, agg = g.ecc_uncorrected_volatile, g.ecc_uncorrected_aggregate
    if vol is None and agg is None:
        return result(name, "skipped", "ECC counters not reported (ECC off, or no NVML)")
    value = {"volatile": vol, "aggregate": agg}
    if vol:
        return result(name, "fail", f"{vol} uncorrectable ECC error(s) since the driver "
                      "loaded", value, 0)
    if agg:
        return result(name, "warn", f"{agg} uncorrectable ECC error(s) in the GPU's "
                      "lifetime", value, 0)
    return result(name, "ok", value=value, threshold=0)


def memory_repair(g: GpuStats) -> PreflightCheck:
    name = f"nvml.remap:gpu{g.index}"
    value = {"remap_pending": g.remapped_rows_pending, "remap_failure": g.remapped_rows_failure,
             "retire_pending": g.retired_pages_pending}
    if g.remapped_rows_failure:
        return result(name, "fail", "row remapping failed: the GPU needs a field diagnostic",
                      value)
    if g.remapped_rows_pending:
        return result(name, "fail", "rows wait to be remapped: reset the GPU first", value)
    if g.retired_pages_pending:
        return result(name, "fail", "pages wait to be retired: reset the GPU first", value)
    if all(v is None for v in value.values()):
        return result(name, "skipped", "remapping and retirement not reported")
    return result(name, "ok", value=value)


def throttle(g: GpuStats) -> PreflightCheck:
    name = f"nvml.clocks:gpu{g.index}"
    reasons = set(g.throttle_reasons)
    hard, soft = sorted(reasons & HARD_THROTTLE), sorted(reasons & SOFT_THROTTLE)
    value = sorted(reasons)
    if hard:
        return result(name, "fail", f"clocks held down by {', '.join(hard)} "
                      f"({g.sm_clock_mhz} MHz, {g.temperature_c} C)", value)
    if soft:
        return result(name, "warn", f"clocks held down by {', '.join(soft)}", value)
    return result(name, "ok", value=value)


def pcie(g: GpuStats) -> PreflightCheck:
    name = f"nvml.pcie:gpu{g.index}"
    if g.pcie_width is None or g.pcie_width_max is None:
        return result(name, "skipped", "PCIe link not reported")
    value = {"gen": g.pcie_gen, "width": g.pcie_width}
    best = {"gen": g.pcie_gen_max, "width": g.pcie_width_max}
    if g.pcie_width < g.pcie_width_max:
        return result(name, "fail", f"PCIe link x{g.pcie_width} of x{g.pcie_width_max}: "
                      "a degraded link (reseat the GPU or its riser)", value, best)
    idle = "gpu_idle" in g.throttle_reasons
    if g.pcie_gen is not None and g.pcie_gen_max is not None and g.pcie_gen < g.pcie_gen_max \
            and not idle:
        return result(name, "warn", f"PCIe Gen{g.pcie_gen} of Gen{g.pcie_gen_max} on a busy "
                      "GPU", value, best)
    return result(name, "ok", value=value, threshold=best)


def processes(g: GpuStats, own: set[int]) -> PreflightCheck:
    """A warning, never a failure: a previous attempt still exiting, another tenant, or
    (in a container) host pids NVML reports that are no process here look the same."""
    name = f"nvml.processes:gpu{g.index}"
    foreign = [p for p in g.processes if p not in own]
    if foreign:
        return result(name, "warn", f"compute process(es) {foreign} already on the GPU",
                      foreign, [])
    return result(name, "ok", value=[])


def nvml(gpus: list[GpuStats], own: set[int] | None = None) -> list[PreflightCheck]:
    """Every per-GPU NVML check."""
    out = []
    for g in gpus:
        out += [ecc(g), memory_repair(g), throttle(g), pcie(g), processes(g, own or set())]
    return out


KERNEL_WINDOW_S: Final = 3600.0
"""A fatal kernel line older than this is history (a GPU reset since may have cleared it):
a warning in the pre-flight, nothing in the straggler checklist."""


def fatal_kernel_line(k: KernelLine) -> bool:
    """A fatal Xid (NVIDIA's catalog, :mod:`trainguard.runtime.xids`) or a memory error."""
    entry = xids.lookup(k.xid) if k.xid is not None else None
    return (entry is not None and entry.fatal) or k.kind == "ecc"


def recent(lines: list[KernelLine], uptime: float | None,
           window: float = KERNEL_WINDOW_S) -> list[KernelLine]:
    """The lines logged within ``window`` seconds of ``uptime`` (seconds since boot, when
    read); a line of unknown age counts as recent."""
    if uptime is None:
        return list(lines)
    return [k for k in lines if k.since_boot is None or uptime - k.since_boot <= window]


def kernel_log(lines: list[KernelLine], readable: bool = True,
               uptime: float | None = None) -> PreflightCheck:
    """Xid and memory-error lines the kernel logged: recent fatal ones fail, older fatal
    ones and the rest warn."""
    if not readable:
        return result("kernel.xid", "skipped", "the kernel log is not readable here")
    now = recent(lines, uptime)
    fatal = [k for k in now if fatal_kernel_line(k)]
    other = [k for k in lines if k not in fatal]
    if fatal:
        codes = sorted({k.xid for k in fatal if k.xid is not None})
        return result("kernel.xid", "fail", f"kernel logged {len(fatal)} fatal GPU error(s)"
                      f"{' (Xid ' + ', '.join(map(str, codes)) + ')' if codes else ''}: "
                      f"{fatal[-1].text[:160]}", [k.text for k in fatal[-3:]])
    if other:
        return result("kernel.xid", "warn", f"kernel logged Xid "
                      f"{', '.join(sorted({str(k.xid) for k in other}))}"
                      + (" (fatal ones over an hour ago)" if any(map(fatal_kernel_line, other))
                         else ""), [k.text for k in other[-3:]])
    return result("kernel.xid", "ok", value=[])


# -- DCGM -------------------------------------------------------------------------------


def dcgm(tests: list[DiagTest], level: int) -> PreflightCheck:
    name = f"dcgm.diag-r{level}"
    counts = {r: sum(1 for t in tests if t.result == r) for r in ("pass", "fail", "warn", "skip")}
    bad = [t for t in tests if t.result == "fail"]
    if bad:
        why = "; ".join(f"{t.name}: {t.notes[0] if t.notes else t.detail}" for t in bad)
        return result(name, "fail", why[:400], counts)
    warned = [t for t in tests if t.result == "warn"]
    if warned:
        return result(name, "warn", "; ".join(t.name for t in warned), counts)
    return result(name, "ok", value=counts)


# -- InfiniBand / RoCE --------------------------------------------------------------------


def expected_rate(port: IbPort, ports: list[IbPort], expected: float) -> float:
    """The rate ``port`` must reach: the setting, else the best among the active ports of
    its link layer."""
    if expected > 0:
        return expected
    peers = [p.rate_gbps for p in ports if p.link_layer == port.link_layer
             and p.rate_gbps is not None and p.state == "ACTIVE"]
    return max(peers, default=0.0)


def ib_port(port: IbPort, ports: list[IbPort], expected: float) -> PreflightCheck:
    name = f"ib:{port.name}"
    want = expected_rate(port, ports, expected)
    value = {"state": port.state, "phys_state": port.phys_state, "rate_gbps": port.rate_gbps}
    if (port.state, port.phys_state) != LINK_UP:
        return result(name, "fail", f"port {port.name} is {port.state or '?'}/"
                      f"{port.phys_state or '?'}, not ACTIVE/LinkUp", value, list(LINK_UP))
    if want and (port.rate_gbps or 0.0) < want:
        return result(name, "fail", f"port {port.name} runs at {port.rate or '?'}, below "
                      f"{want:g} Gb/sec: a degraded link", value, want)
    return result(name, "ok", value=value, threshold=want or None)


def ib(ports: list[IbPort], expected: float) -> list[PreflightCheck]:
    if not ports:
        return [result("ib", "skipped", "no InfiniBand/RoCE port in sysfs")]
    return [ib_port(p, ports, expected) for p in ports]


def degraded_ports(ports: list[IbPort], expected: float) -> list[PreflightCheck]:
    """The ports that fail :func:`ib_port` (the straggler checklist's "degraded link")."""
    return [c for c in ib(ports, expected) if c.status == "fail"]


# -- measured -----------------------------------------------------------------------------


def bandwidth(r: BandwidthResult, floor: float) -> PreflightCheck:
    name = f"allreduce.{r.backend or 'local'}"
    if r.skipped:
        return result(name, "skipped", r.skipped, threshold=floor)
    if r.error:  # the test itself failed (a timeout, a torch build without the backend)
        return result(name, "warn", r.error, threshold=floor)
    value = {"busbw_gbps": r.busbw_gbps, "ranks": r.ranks}
    if not r.exact:
        return result(name, "fail", "the all-reduce's sums came out wrong: data corrupted "
                      "between devices", value, floor)
    if r.busbw_gbps < floor:
        return result(name, "fail", f"all-reduce bus bandwidth {r.busbw_gbps:g} GB/s among "
                      f"{r.ranks} ranks, below {floor:g} GB/s", value, floor)
    return result(name, "ok", value=value, threshold=floor)


def disk(r: DiskResult | None, floor: float) -> PreflightCheck:
    """A warning at worst: the checkpoint root is most often shared, and a slow one would
    keep every node out of every job."""
    if r is None:
        return result("disk", "skipped", "no checkpoint root set (TRAINGUARD_CHECKPOINT_ROOT)")
    if r.error:
        return result("disk", "warn", r.error, threshold=floor)
    if r.mbps < floor:
        return result("disk", "warn", f"checkpoint root writes {r.mbps:g} MB/s "
                      f"(fsync included), below {floor:g} MB/s", r.mbps, floor)
    return result("disk", "ok", value=r.mbps, threshold=floor)


# -- the straggler checklist's CPU verdict --------------------------------------------------


def _busy(load: CpuLoad) -> tuple[float, str] | None:
    """The 1-minute load, else the runnable tasks (one instant: too noisy to compare when
    the average is there), with how to say it."""
    if load.load1 is not None:
        return load.load1, f"1-minute load {load.load1:g}"
    if load.runnable is not None:
        return float(load.runnable), f"{load.runnable} runnable tasks"
    return None


def cpu_contention(load: CpuLoad | None, *, steal_pct: float, load_ratio: float,
                   peers: Sequence[CpuLoad] = ()) -> str:
    """Why the host's CPUs are contended ("" if they are not): the hypervisor stealing
    more than ``steal_pct`` of CPU time, or a 1-minute load (without one, runnable tasks)
    above ``load_ratio`` times the CPUs.

    ``peers``: the other hosts' readings. Then only contention beyond theirs counts
    (steal ``steal_pct`` above their median, load ``load_ratio`` times theirs): the same
    load on every host is the fleet's, or one machine's, not what slows this host alone."""
    if load is None:
        return ""
    why = []
    steals = [p.steal_pct for p in peers if p.steal_pct is not None]
    usual_steal = statistics.median(steals) if steals else 0.0
    if load.steal_pct is not None and load.steal_pct > steal_pct + usual_steal:
        why.append(f"{load.steal_pct:g}% of CPU time stolen by the hypervisor"
                   + (f" (other hosts {usual_steal:g}%)" if steals else ""))
    theirs = [b[0] / max(1, p.cpus) for p in peers if (b := _busy(p)) is not None]
    usual = statistics.median(theirs) if theirs else 0.0
    cpus = max(1, load.cpus)
    mine = _busy(load)
    if mine is not None and mine[0] > load_ratio * max(1.0, usual) * cpus:
        why.append(f"{mine[1]} on {cpus} CPUs"
                   + (f" (other hosts {usual:.2g} per CPU)" if theirs else ""))
    return ", ".join(why)
