"""Diagnoser settings."""

from __future__ import annotations

import dataclasses

from trainguard.runtime.config import Settings


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiagnoserSettings(Settings):
    correlation_window: float = 60.0
    """Anomalies of one job this close together may share a root cause."""
    gpu_window: float = 120.0
    """How far back GPU samples count as evidence."""
    same_cause_window: float = 10.0
    """The same cause on the same hosts this soon after is the same failure."""
    symptom_window: float = 20.0
    """A hang or silence this soon after a root failure is its symptom."""
    dedupe_ttl: float = 7 * 86400.0
    straggler_steal_pct: float = 10.0
    """A straggler's host whose hypervisor steals more CPU time than this (%) has
    contended CPUs (``straggler_cpu``)."""
    straggler_load_ratio: float = 1.5
    """A straggler's host whose 1-minute load (or runnable tasks) passes this many per
    CPU has contended CPUs."""
