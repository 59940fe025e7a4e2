"""What the diagnoser knows, as data: exit-text signatures and recommended actions.

Kept apart from the rules so a reader (or a test table) sees the whole vocabulary at once.
The exit-text signatures live in ``error-signatures.toml`` (loaded by :mod:`.signatures`);
XIDs are not listed there: what each one means, whether it is fatal, its cause and action
come from NVIDIA's catalog through :mod:`trainguard.runtime.xids`, the table the detector uses too.
"""

from __future__ import annotations

import re
from typing import Final

from trainguard.contract.schemas import Cause

from . import signatures

# The exit-text patterns are data (error-signatures.toml, read by .signatures); the peer
# errors are the signatures marked ``peer``.
PEER_ERROR: Final = signatures.knowledge().peer
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
    "straggler_link": ("alert", "isolate"),
    "straggler_cpu": ("alert",),
    "straggler_foreign_process": ("alert",),
    "straggler": ("alert", "isolate"),
    "data_pipeline": ("alert",),
    "process_crash": ("restart",),
    "rank_hang": ("dump", "restart"),
    "hosts_lost": ("isolate", "restart"),
    "unknown": ("escalate",),
}
"""Section 6's default actions; the remediator's policy decides what actually runs
(``isolate`` for stragglers only if sustained and allowed)."""

THERMAL_REASONS: Final = frozenset({"hw_thermal_slowdown", "sw_thermal_slowdown"})
POWER_REASONS: Final = frozenset({"hw_power_brake_slowdown", "sw_power_cap", "hw_slowdown"})
HOT_C: Final = 85.0
