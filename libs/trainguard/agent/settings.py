"""The agent's settings: the shared ones plus what only a node agent needs."""

from __future__ import annotations

import dataclasses
from typing import Final

from trainguard.contract.errors import ConfigError
from trainguard.health.settings import PreflightSettings

PREFLIGHT_MODES: Final = ("enforce", "warn", "off")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentSettings(PreflightSettings):
    # job, host, allow_drills (and the shared nats_url, prefix) are read from the same
    # TRAINGUARD_* names the agent then sets for its ranks (trainguard.contract.envnames).
    job: str = ""
    host: str = ""
    allow_drills: bool = False
    node_interval: float = 1.0
    """Seconds between node heartbeats (process state of each local rank)."""
    state_interval: float = 0.1
    """Seconds between looks at the ranks' process states: a rank stopped (SIGSTOP) or
    gone is beaten about at once, not at the next ``node_interval``."""
    gpu_interval: float = 5.0
    """Seconds between GPU samples sent (with the host probe's facts) on a quiet node."""
    gpu_look_interval: float = 1.0
    """Seconds between looks at the GPUs' fault counters and XIDs: a fault is sent at once
    (:func:`trainguard.agent.gpu.alarm`), not at the next ``gpu_interval``."""
    stop_grace: float = 10.0
    """SIGTERM-to-SIGKILL grace when the agent stops workers (restart, stop)."""
    preempt_grace: float = 30.0
    """On SIGTERM to ``trainguard launch``: how long a save-now may take before stopping."""
    rank_credentials: str = ""
    """The rank role's credentials file, handed to the ranks (``TRAINGUARD_CREDENTIALS`` of
    their environment); the agent's own is ``credentials``. ``{rank}`` in it becomes each
    rank's number: one file per rank (``rank-J-{rank}.creds``, ``jwt`` mode); or
    ``{local_rank}`` each process's local rank (the agent's own files in ``jwt`` mode)."""
    warm_spares: int | None = None
    """Warm spares kept per node (processes with torch imported, waiting to replace a
    rank); None (the default): one per local rank, so a whole-group restart is warm for
    every rank; 0 turns them off."""
    spare_refill_delay: float = 1.0
    """Seconds after a group (or a rank) started before used spares are refilled, so the
    refill's imports do not compete with the new ranks' start."""
    in_place: bool = True
    """Replace a single failed rank in place (its survivors keep running and hand it their
    state) when every rank declared it can; off: every failure restarts the group."""
    log_root: str = ""
    """Where launches keep their logs, one directory per job (``<log_root>/<job>/<host>-<UTC
    time>-<pid>``); empty: ``trainguard-logs`` in the system's temporary directory."""
    log_keep: int = 10
    """Launch directories kept per job and host; older ones are removed at the next launch."""
    log_max_age_h: float = 168.0
    """Hours after which any job's launch directory (not in use) is removed at a launch."""
    scripted_gpus: int = 0
    """Fake GPUs for drills on machines without one (0: only with --allow-drills, 1 GPU)."""
    preflight: str = "enforce"
    """The pre-flight before the ranks start: ``enforce`` (a node that fails starts no
    rank and exits 200), ``warn`` (it starts them, with a warning), ``off`` (not run)."""
    preflight_verdict_wait: float = 5.0
    """Seconds a failed node waits for the remediator's blocklist entry, to print why it
    is kept out (the exit does not depend on it)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.preflight not in PREFLIGHT_MODES:
            raise ConfigError(f"setting preflight={self.preflight!r}: use one of "
                              f"{', '.join(PREFLIGHT_MODES)} (TRAINGUARD_PREFLIGHT or "
                              "--preflight)")
        if self.preflight_verdict_wait < 0:
            raise ConfigError(f"setting preflight_verdict_wait={self.preflight_verdict_wait}: "
                              "must be 0 or more seconds (TRAINGUARD_PREFLIGHT_VERDICT_WAIT)")
        for name in ("node_interval", "state_interval", "gpu_interval", "gpu_look_interval"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"setting {name}={getattr(self, name)}: must be a positive "
                                  "number of seconds")
        if self.log_keep < 1:
            raise ConfigError(f"setting log_keep={self.log_keep}: keep at least 1 launch's "
                              "logs (TRAINGUARD_LOG_KEEP)")
        if self.log_max_age_h <= 0:
            raise ConfigError(f"setting log_max_age_h={self.log_max_age_h}: must be a positive "
                              "number of hours (TRAINGUARD_LOG_MAX_AGE_H)")
