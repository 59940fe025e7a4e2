"""Diagnoser settings."""

from __future__ import annotations

import dataclasses

from trainguard.contract.errors import ConfigError
from trainguard.runtime.config import Settings
from trainguard.runtime.domains import LabelKeys


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
    domain_window: float = 2.0
    """Hosts whose heartbeats stop within this many seconds of each other, in one failure
    domain, are one loss (``hosts_lost``: one incident, one page); a host's silence waits
    this long for the others before it is diagnosed. 0: every host on its own. Keep it above
    the ranks' heartbeat period (1 s), whose phase spreads the onsets of one loss."""
    burst_window: float = 2.0
    """Crashes of one job with the same cause whose exits lie within this many seconds of
    each other crashed together (a storm; a bug every rank hits at one step): one failure,
    one incident, one page, whatever their hosts, unless the cause isolates hosts (each
    host then has its own). 0: crashes on other hosts are each their own failure."""
    topology: str = ""
    """The failure domains: a TOML/JSON ``[[domains]]`` file, ``kubectl get nodes -o json``
    saved to a file, or Slurm's ``topology.conf``; empty: none (hosts lost together are
    grouped with the domain unknown)."""
    topology_switch_label: str = "network.topology.kubernetes.io/switch"
    """The node label naming a host's switch, in a Kubernetes NodeList ``topology``."""
    topology_rack_label: str = "topology.kubernetes.io/rack"
    topology_zone_label: str = "topology.kubernetes.io/zone"

    def __post_init__(self) -> None:
        if self.domain_window < 0:
            raise ConfigError(f"setting domain_window={self.domain_window}: must be >= 0 "
                              "(0 turns the grouping of hosts lost together off)")
        if self.burst_window < 0:
            raise ConfigError(f"setting burst_window={self.burst_window}: must be >= 0 "
                              "(0 turns the grouping of ranks that crash together off)")

    @property
    def label_keys(self) -> LabelKeys:
        return LabelKeys(switch=self.topology_switch_label, rack=self.topology_rack_label,
                         zone=self.topology_zone_label)
