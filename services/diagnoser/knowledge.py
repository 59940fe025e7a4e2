"""What the diagnoser knows, as data: exit-text patterns and recommended actions.

Kept apart from the rules so a reader (or a test table) sees the whole vocabulary at once.
XIDs are not listed here: what each one means, whether it is fatal and which cause it
points at come from NVIDIA's catalog through :mod:`trainguard.xids`, the table the detector
uses too; the exit-text patterns below take their XID codes from it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from trainguard import xids
from trainguard.schemas import Cause


@dataclass(frozen=True)
class TextPattern:
    cause: Cause
    regex: re.Pattern[str]
    fact: str
    weight: float
    """How much this text alone says (0..1); the strongest match wins."""


def _p(cause: Cause, pattern: str, fact: str, weight: float) -> TextPattern:
    return TextPattern(cause, re.compile(pattern, re.IGNORECASE), fact, weight)


def _xid_named(cause: Cause) -> str:
    """A pattern for "Xid 79" (and the like) naming any XID the table gives ``cause``."""
    codes = "|".join(str(code) for code in sorted(xids.codes_with(cause)))
    return rf"xid[ :]*({codes})\b"


# Order matters only for equal weights: hardware before software.
EXIT_PATTERNS: Final[tuple[TextPattern, ...]] = (
    _p("gpu_lost", _xid_named("gpu_lost") + r"|fallen off the bus|gpu is lost|"
       r"unable to determine the device handle|no cuda-capable device", "the GPU is gone", 0.95),
    _p("hbm_ecc", r"uncorrectable ecc|ecc error|double[- ]bit|" + _xid_named("hbm_ecc")
       + r"|row remap", "an ECC error was reported", 0.9),
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
