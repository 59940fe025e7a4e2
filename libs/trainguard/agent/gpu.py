"""GPU telemetry: a small source interface, the NVML implementation and a scripted one.

The NVML source reads every counter the diagnoser uses (temperatures, power, clocks and
throttle reasons, ECC volatile/aggregate, retired pages and remapped rows pending, PCIe
replays, NVLink errors) and waits for XID events on an NVML event set. Without a GPU or a
driver, :func:`open_source` returns None with a reason, and the agent runs on. The scripted
source plays ECC/XID/throttle evidence for drills.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any, Protocol

import msgspec

from trainguard.contract.errors import ConfigError
from trainguard.contract.schemas import GpuStats, XidEvent
from trainguard.health import nvsmi

# NVML clock-event (throttle) reason bits, named as the diagnoser reads them.
THROTTLE_BITS: dict[int, str] = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap",
    0x8: "hw_slowdown", 0x10: "sync_boost", 0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


def throttle_names(mask: int) -> list[str]:
    return [name for bit, name in THROTTLE_BITS.items() if mask & bit]


_FLAGS = ("retired_pages_pending", "remapped_rows_pending", "remapped_rows_failure")
_COUNTS = ("ecc_uncorrected_volatile", "ecc_uncorrected_aggregate")


def alarm(sent: list[GpuStats] | None, now: list[GpuStats], xids: list[XidEvent]) -> str:
    """Why a reading cannot wait for the next regular sample ("" when it can): an XID, an
    uncorrectable ECC count that rose, a page retirement or row remap now pending or failed,
    or a GPU gone since the last sample sent. Looked for every ``gpu_look_interval``, so a
    GPU's fault reaches the diagnoser within about a second, not ``gpu_interval``."""
    if xids:
        return f"XID {xids[0].code} on GPU {xids[0].gpu}"
    if sent is None:
        return ""
    before = {g.index: g for g in sent}
    if len(now) < len(sent):
        gone = sorted(before.keys() - {g.index for g in now})
        return f"GPU {gone[0] if gone else '?'} no longer read"
    for g in now:
        old = before.get(g.index)
        if old is None:
            continue
        for name in _COUNTS:
            if (getattr(g, name) or 0) > (getattr(old, name) or 0):
                return f"GPU {g.index}: {name} rose to {getattr(g, name)}"
        for name in _FLAGS:
            if getattr(g, name) and not getattr(old, name):
                return f"GPU {g.index}: {name}"
    return ""


class GpuSource(Protocol):
    name: str

    def sample(self) -> list[GpuStats]: ...

    def xids(self) -> list[XidEvent]:
        """XID events since the last call (never blocks for long)."""
        ...

    def close(self) -> None: ...


class NvmlSource:
    name = "nvml"

    def __init__(self) -> None:
        import pynvml

        self._nvml: Any = pynvml
        pynvml.nvmlInit()
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                         for i in range(pynvml.nvmlDeviceGetCount())]
        self._events: Any = None
        try:
            self._events = pynvml.nvmlEventSetCreate()
            for h in self._handles:
                with contextlib.suppress(pynvml.NVMLError):
                    pynvml.nvmlDeviceRegisterEvents(
                        h, pynvml.nvmlEventTypeXidCriticalError, self._events)
        except pynvml.NVMLError:
            self._events = None

    def _read(self, fn: str, *args: Any) -> Any:
        try:
            return getattr(self._nvml, fn)(*args)
        except Exception:
            return None

    def sample(self) -> list[GpuStats]:
        n = self._nvml
        out = []
        for i, h in enumerate(self._handles):
            mem = self._read("nvmlDeviceGetMemoryInfo", h)
            util = self._read("nvmlDeviceGetUtilizationRates", h)
            power = self._read("nvmlDeviceGetPowerUsage", h)
            limit = self._read("nvmlDeviceGetEnforcedPowerLimit", h)
            reasons = self._read("nvmlDeviceGetCurrentClocksEventReasons", h)
            if reasons is None:
                reasons = self._read("nvmlDeviceGetCurrentClocksThrottleReasons", h)
            ecc = {}
            for key, err, counter in (
                ("ecc_corrected_volatile", n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_VOLATILE_ECC),
                ("ecc_uncorrected_volatile", n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                 n.NVML_VOLATILE_ECC),
                ("ecc_corrected_aggregate", n.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                 n.NVML_AGGREGATE_ECC),
                ("ecc_uncorrected_aggregate", n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                 n.NVML_AGGREGATE_ECC),
            ):
                ecc[key] = self._read("nvmlDeviceGetTotalEccErrors", h, err, counter)
            remap = self._read("nvmlDeviceGetRemappedRows", h)
            procs = self._read("nvmlDeviceGetComputeRunningProcesses", h) or []
            pending = self._read("nvmlDeviceGetRetiredPagesPendingStatus", h)
            nvlink = 0
            any_link = False
            for link in range(18):
                v = self._read("nvmlDeviceGetNvLinkErrorCounter", h, link,
                               n.NVML_NVLINK_ERROR_DL_CRC_FLIT)
                if v is not None:
                    nvlink += int(v)
                    any_link = True
            uuid = self._read("nvmlDeviceGetUUID", h)
            name = self._read("nvmlDeviceGetName", h)
            out.append(GpuStats(
                index=i,
                uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid or ""),
                name=name.decode() if isinstance(name, bytes) else str(name or ""),
                temperature_c=_f(self._read("nvmlDeviceGetTemperature", h,
                                            n.NVML_TEMPERATURE_GPU)),
                power_w=power / 1000.0 if power is not None else None,
                power_limit_w=limit / 1000.0 if limit is not None else None,
                sm_clock_mhz=_f(self._read("nvmlDeviceGetClockInfo", h, n.NVML_CLOCK_SM)),
                throttle_reasons=throttle_names(int(reasons)) if reasons is not None else [],
                util_pct=_f(util.gpu) if util is not None else None,
                mem_used=int(mem.used) if mem is not None else None,
                mem_total=int(mem.total) if mem is not None else None,
                retired_pages_pending=bool(pending) if pending is not None else None,
                remapped_rows_pending=bool(remap[2]) if remap is not None else None,
                remapped_rows_failure=bool(remap[3]) if remap is not None else None,
                pcie_gen=_i(self._read("nvmlDeviceGetCurrPcieLinkGeneration", h)),
                pcie_gen_max=_i(self._read("nvmlDeviceGetMaxPcieLinkGeneration", h)),
                pcie_width=_i(self._read("nvmlDeviceGetCurrPcieLinkWidth", h)),
                pcie_width_max=_i(self._read("nvmlDeviceGetMaxPcieLinkWidth", h)),
                processes=sorted(int(p.pid) for p in procs),
                pcie_replay=_i(self._read("nvmlDeviceGetPcieReplayCounter", h)),
                nvlink_errors=nvlink if any_link else None,
                **ecc,
            ))
        return out

    def xids(self) -> list[XidEvent]:
        if self._events is None:
            return []
        found: list[XidEvent] = []
        n = self._nvml
        while True:
            try:
                data = n.nvmlEventSetWait_v2(self._events, 0)
            except n.NVMLError:
                break
            index = next((i for i, h in enumerate(self._handles) if h == data.device), -1)
            found.append(XidEvent(gpu=index, code=int(data.eventData), time=time.time()))
        return found

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self._events is not None:
                self._nvml.nvmlEventSetFree(self._events)
            self._nvml.nvmlShutdown()


def _f(v: Any) -> float | None:
    return float(v) if v is not None else None


def _i(v: Any) -> int | None:
    return int(v) if v is not None else None


class RecordedSource:
    """A recorded ``nvidia-smi -q`` report played as every sample (``gpu_reading``): a
    node's GPUs as they were, for drills and tests on machines without them."""

    def __init__(self, path: str) -> None:
        try:
            with open(path) as f:
                self._stats = nvsmi.gpus(f.read())
        except OSError as exc:
            raise ConfigError(f"setting gpu_reading={path!r}: cannot read it ({exc.strerror}); "
                              "give an nvidia-smi -q report (TRAINGUARD_GPU_READING)") from None
        if not self._stats:
            raise ConfigError(f"setting gpu_reading={path!r}: no GPU in it; give the output "
                              "of nvidia-smi -q (TRAINGUARD_GPU_READING)")
        self.name = f"recorded:{os.path.basename(path)}"

    def sample(self) -> list[GpuStats]:
        return [msgspec.structs.replace(g) for g in self._stats]

    def xids(self) -> list[XidEvent]:
        return []

    def close(self) -> None:
        pass


class ScriptedSource:
    """Plays evidence for drills: ECC counts rising, XIDs, throttling, on top of a
    healthy-looking GPU (or on top of a real source's readings)."""

    name = "scripted"

    def __init__(self, gpus: int = 1, base: GpuSource | None = None) -> None:
        self._base = base
        self._gpus = gpus
        self._lock = threading.Lock()
        self._ecc_uncorrected: dict[int, int] = {}
        self._throttle: dict[int, list[str]] = {}
        self._pending_xids: list[XidEvent] = []
        self.name = f"scripted+{base.name}" if base else "scripted"

    def real_gpus(self) -> int:
        """The devices under the script (a real source's), none without one."""
        return len(self._base.sample()) if self._base else 0

    def inject_ecc(self, gpu: int = 0, count: int = 1) -> None:
        with self._lock:
            self._ecc_uncorrected[gpu] = self._ecc_uncorrected.get(gpu, 0) + count

    def inject_xid(self, code: int, gpu: int = 0) -> None:
        with self._lock:
            self._pending_xids.append(XidEvent(gpu=gpu, code=code, time=time.time(),
                                               detail="scripted"))

    def inject_throttle(self, reasons: list[str], gpu: int = 0) -> None:
        with self._lock:
            self._throttle[gpu] = list(reasons)

    def sample(self) -> list[GpuStats]:
        stats = self._base.sample() if self._base else [
            GpuStats(index=i, uuid=f"GPU-scripted-{i}", name="scripted", temperature_c=45.0,
                     power_w=100.0, power_limit_w=700.0, sm_clock_mhz=1980.0,
                     ecc_uncorrected_volatile=0, ecc_uncorrected_aggregate=0)
            for i in range(self._gpus)]
        with self._lock:
            for s in stats:
                extra = self._ecc_uncorrected.get(s.index, 0)
                if extra:
                    s.ecc_uncorrected_volatile = (s.ecc_uncorrected_volatile or 0) + extra
                    s.ecc_uncorrected_aggregate = (s.ecc_uncorrected_aggregate or 0) + extra
                    s.remapped_rows_pending = True
                if s.index in self._throttle:
                    s.throttle_reasons = sorted(set(s.throttle_reasons) |
                                                set(self._throttle[s.index]))
                    if "hw_thermal_slowdown" in self._throttle[s.index]:
                        s.temperature_c = 92.0
        return stats

    def xids(self) -> list[XidEvent]:
        with self._lock:
            found, self._pending_xids = self._pending_xids, []
        return (self._base.xids() if self._base else []) + found

    def close(self) -> None:
        if self._base:
            self._base.close()


def open_source(reading: str = "") -> tuple[GpuSource | None, str]:
    """The NVML source (or the recorded ``reading``), or None and the reason there is none
    (no GPU, no driver)."""
    if reading:
        recorded = RecordedSource(reading)
        return recorded, f"{len(recorded.sample())} GPU(s) from {reading}"
    try:
        source = NvmlSource()
    except ImportError:
        return None, "nvidia-ml-py is not installed (pip install 'trainguard[gpu]')"
    except Exception as exc:
        return None, f"NVML unavailable: {exc}"
    if not source._handles:
        source.close()
        return None, "no GPU found by NVML"
    return source, f"{len(source._handles)} GPU(s) via NVML"
