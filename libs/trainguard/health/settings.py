"""The pre-flight's thresholds and where the host's readings are: one settings object.

``trainguard preflight`` loads :class:`PreflightSettings`; the agent's settings extend it,
so ``trainguard launch`` reads the same ``TRAINGUARD_PREFLIGHT_*`` names (and flags).
"""

from __future__ import annotations

import dataclasses
from typing import Final

from trainguard.contract.errors import ConfigError
from trainguard.contract.schemas import PREFLIGHT_CHECKS
from trainguard.runtime.config import Settings

CHECKS: Final = PREFLIGHT_CHECKS


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreflightSettings(Settings):
    sysfs_root: str = "/sys"
    """Where sysfs is (InfiniBand ports under ``class/infiniband``); a recorded tree can
    stand in."""
    proc_root: str = "/proc"
    """Where procfs is (``stat``, ``loadavg``, ``<pid>/comm``)."""
    kernel_log: str = "/dev/kmsg"
    """The kernel log the Xid and ECC lines are read from (a file of recorded lines can
    stand in); unreadable, those checks see no lines."""
    gpu_reading: str = ""
    """A recorded ``nvidia-smi -q`` dump read instead of NVML (drills, tests); empty: NVML."""
    preflight_checks: str = ",".join(CHECKS)
    """The checks to run, comma-separated, from: nvml, dcgm, ib, allreduce, disk."""
    preflight_dcgm_level: int = 1
    """``dcgmi diag -r <level>`` (1: seconds, 2: about two minutes); 0: do not run it."""
    preflight_ib_rate_gbps: float = 0.0
    """The rate every InfiniBand/RoCE port must reach (200 for 4X HDR); 0: the best rate
    among the node's ports of the same link layer."""
    preflight_allreduce_mb: float = 32.0
    """Megabytes each rank all-reduces in the node-local bandwidth test."""
    preflight_allreduce_iters: int = 5
    preflight_allreduce_procs: int = 0
    """Ranks of the bandwidth test: 0 means one per GPU (none, so skipped, on a node
    without GPUs); N runs N ranks (gloo over loopback where there are no GPUs)."""
    preflight_nccl_floor_gbps: float = 5.0
    """The lowest NCCL all-reduce bus bandwidth (GB/s) between the node's GPUs."""
    preflight_gloo_floor_gbps: float = 0.05
    """The lowest gloo all-reduce bus bandwidth (GB/s) over loopback (nodes without GPUs)."""
    checkpoint_root: str = ""
    """The checkpoint root whose write throughput is tested (``TRAINGUARD_CHECKPOINT_ROOT``,
    the one the ranks and the coordinator use); empty: the disk check is skipped."""
    preflight_disk_mb: float = 64.0
    """Megabytes written and fsynced to the checkpoint root."""
    preflight_disk_floor_mbps: float = 50.0
    """The lowest write throughput (MB/s) to the checkpoint root."""
    preflight_timeout_s: float = 120.0
    """How long one check (dcgmi, the bandwidth test) may run before it fails."""

    def __post_init__(self) -> None:
        unknown = [c for c in self.checks() if c not in CHECKS]
        if unknown:
            raise ConfigError(f"setting preflight_checks={self.preflight_checks!r}: unknown "
                              f"check {unknown[0]!r}; use a comma-separated list of "
                              f"{', '.join(CHECKS)} (TRAINGUARD_PREFLIGHT_CHECKS or "
                              "--checks)")
        for name in ("preflight_allreduce_mb", "preflight_disk_mb", "preflight_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"setting {name}={getattr(self, name)}: must be a positive "
                                  f"number (TRAINGUARD_{name.upper()})")
        for name in ("preflight_ib_rate_gbps", "preflight_nccl_floor_gbps",
                     "preflight_gloo_floor_gbps", "preflight_disk_floor_mbps",
                     "preflight_allreduce_procs", "preflight_dcgm_level"):
            if getattr(self, name) < 0:
                raise ConfigError(f"setting {name}={getattr(self, name)}: must be 0 or more "
                                  f"(TRAINGUARD_{name.upper()})")
        if self.preflight_allreduce_iters < 1:
            raise ConfigError(f"setting preflight_allreduce_iters="
                              f"{self.preflight_allreduce_iters}: run at least 1 iteration "
                              "(TRAINGUARD_PREFLIGHT_ALLREDUCE_ITERS)")

    def checks(self) -> list[str]:
        return [c.strip() for c in self.preflight_checks.split(",") if c.strip()]
