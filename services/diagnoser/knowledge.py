"""What the diagnoser knows, as data: XID codes, exit-text patterns, recommended actions.

Kept apart from the rules so a reader (or a test table) sees the whole vocabulary at once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from trainguard.schemas import Cause


@dataclass(frozen=True)
class Xid:
    code: int
    meaning: str
    cause: Cause
    fatal: bool


# NVIDIA XID catalogue, the codes that matter for training jobs.
XIDS: Final[dict[int, Xid]] = {x.code: x for x in (
    Xid(13, "graphics engine exception (often an application bug)", "process_crash", False),
    Xid(31, "GPU memory page fault (often an application bug)", "process_crash", False),
    Xid(43, "GPU stopped processing (application fault)", "process_crash", False),
    Xid(48, "double-bit ECC error", "hbm_ecc", True),
    Xid(63, "ECC page retirement / row remapping recorded", "hbm_ecc", False),
    Xid(64, "ECC page retirement / row remapping failure", "hbm_ecc", True),
    Xid(74, "NVLink error", "network", True),
    Xid(79, "GPU has fallen off the bus", "gpu_lost", True),
    Xid(92, "high single-bit ECC error rate", "hbm_ecc", False),
    Xid(94, "contained uncorrectable ECC error", "hbm_ecc", True),
    Xid(95, "uncontained uncorrectable ECC error", "gpu_lost", True),
)}


@dataclass(frozen=True)
class TextPattern:
    cause: Cause
    regex: re.Pattern[str]
    fact: str
    weight: float
    """How much this text alone says (0..1); the strongest match wins."""


def _p(cause: Cause, pattern: str, fact: str, weight: float) -> TextPattern:
    return TextPattern(cause, re.compile(pattern, re.IGNORECASE), fact, weight)


# Order matters only for equal weights: hardware before software.
EXIT_PATTERNS: Final[tuple[TextPattern, ...]] = (
    _p("gpu_lost", r"xid[ :]*(79|95)\b|fallen off the bus|gpu is lost|"
       r"unable to determine the device handle|no cuda-capable device", "the GPU is gone", 0.95),
    _p("hbm_ecc", r"uncorrectable ecc|ecc error|double[- ]bit|xid[ :]*(48|63|64|94)\b|"
       r"row remap", "an ECC error was reported", 0.9),
    _p("oom", r"out of memory|outofmemoryerror|cuda_error_out_of_memory|cannot allocate memory",
       "the process ran out of memory", 0.9),
    _p("gpu_lost", r"cuda error: (unknown error|an illegal memory access|launch failure)|"
       r"cudaerrorillegaladdress|unhandled cuda error", "a CUDA error aborted the process", 0.7),
    _p("network", r"connection (closed|reset) by peer|connectfullmesh|gloo.*(timeout|timed out)|"
       r"nccl.*(timeout|timed out|remote process exited|error)|watchdog caught collective|"
       r"socket timeout|broken pipe|no route to host", "a collective or connection failed", 0.6),
)
PEER_ERROR: Final = re.compile(
    r"connection (closed|reset) by peer|remote process exited|broken pipe|"
    r"watchdog caught collective|connectfullmesh|gloo.*(timeout|timed out)", re.IGNORECASE)
"""Errors a rank shows because *another* rank died: collateral, never a root."""
TRACEBACK: Final = re.compile(r"Traceback \(most recent call last\)|^\w+(Error|Exception):",
                              re.MULTILINE)

RECOMMENDED: Final[dict[Cause, tuple[str, ...]]] = {
    "gpu_lost": ("save_now", "isolate", "restart"),
    "hbm_ecc": ("isolate", "restart"),
    "network": ("restart",),
    "storage_io": ("alert",),
    "oom": ("restart",),
    "numeric": ("rollback",),
    "sdc_suspect": ("isolate", "rollback"),
    "straggler_thermal": ("alert", "isolate"),
    "straggler_power": ("alert", "isolate"),
    "straggler": ("alert", "isolate"),
    "data_pipeline": ("alert",),
    "process_crash": ("restart",),
    "rank_hang": ("dump", "restart"),
    "unknown": ("escalate",),
}
"""Section 6's default actions; the remediator's policy decides what actually runs
(``isolate`` for stragglers only if sustained and allowed)."""

THERMAL_REASONS: Final = frozenset({"hw_thermal_slowdown", "sw_thermal_slowdown"})
POWER_REASONS: Final = frozenset({"hw_power_brake_slowdown", "sw_power_cap", "hw_slowdown"})
HOT_C: Final = 85.0
