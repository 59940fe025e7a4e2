"""The coordinator's settings: defaults, ``TRAINGUARD_<FIELD>`` env variables, overrides."""

from __future__ import annotations

import dataclasses

from trainguard.contract.errors import ConfigError
from trainguard.runtime.config import Settings

VERIFY_MODES = ("size", "full")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointerSettings(Settings):
    """Knobs of the checkpoint coordinator (README of libs/trainguard/services/checkpointer)."""

    commit_deadline: float = 120.0
    """Seconds from the first report of a step until ranks still missing fail it."""
    verify: str = "size"
    """``size``: every reported file exists with the reported size; ``full``: also re-read
    each file and compare its CRC32 (costs a full read of the checkpoint)."""
    require_metadata: bool = True
    """A DCP checkpoint without ``.metadata`` cannot be loaded: refuse to commit one."""
    checkpoint_root: str = ""
    """If set, reports whose path lies outside this directory are rejected. The same
    ``TRAINGUARD_CHECKPOINT_ROOT`` tells ranks where ``LATEST`` is (``Guard.resume_point``)."""
    save_deadline: float = 120.0
    """Default deadline of a save-now request, in seconds."""
    save_margin_steps: int = 2
    save_margin_seconds: float = 2.0
    """``at_step`` = newest step + max(margin steps, margin seconds / median step time)."""
    save_retries: int = 5
    """How often a save-now is re-sent with a later ``at_step`` after ``too_late`` acks."""
    progress_max_age: float = 15.0
    """Older detector progress is ignored (commands then use ``seq`` instead of ``at_step``)."""
    interval_min: float = 60.0
    interval_max: float = 3600.0
    """Bounds of the Young/Daly interval, in seconds."""
    mtbf_prior: float = 86400.0
    """The job's mean time between failures before it has failed (seconds)."""
    interval_change: float = 0.2
    """Publish a new interval only when it moves by more than this fraction."""
    interval_window: int = 5
    """Recent committed checkpoints whose blocking cost is the median C."""
    retain: int = 3
    """Newest committed, non-suspect checkpoints kept (the pinned one is kept besides)."""
    delete_files: bool = False
    """Delete the files of checkpoints retention lets go (never pending, failed or pinned)."""
    catalogue_limit: int = 200
    """Records kept per job in the catalogue; the oldest closed ones beyond it are dropped."""
    suspect_kinds: str = "nonfinite,sdc_mismatch"
    """Anomaly kinds whose open onset makes later checkpoints suspect."""
    failure_kinds: str = "crash,hang"
    """Anomaly kinds counted as failures for the MTBF (incidents count too)."""
    tick: float = 0.5
    """Seconds between deadline checks and event-outbox retries (and writes of the ranks'
    memory snapshot reports)."""
    memory_ttl: float = 600.0
    """Seconds a rank's memory snapshot report is kept after it arrived: a rank silent
    that long (its process gone, or no longer taking snapshots) drops out of the summary."""

    def __post_init__(self) -> None:
        if self.verify not in VERIFY_MODES:
            raise ConfigError(f"setting verify={self.verify!r}: use one of "
                              f"{', '.join(VERIFY_MODES)}")
        if not 0 < self.interval_min <= self.interval_max:
            raise ConfigError(f"interval bounds {self.interval_min}..{self.interval_max}: "
                              "need 0 < interval_min <= interval_max")
        for name in ("commit_deadline", "save_deadline", "mtbf_prior", "tick", "memory_ttl"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"setting {name}={getattr(self, name)!r} must be positive")
        if self.retain < 1:
            raise ConfigError(f"setting retain={self.retain}: keep at least one checkpoint")
        if self.interval_change < 0:
            raise ConfigError(f"setting interval_change={self.interval_change} must be >= 0")

    @property
    def suspect_kind_set(self) -> frozenset[str]:
        return frozenset(k.strip() for k in self.suspect_kinds.split(",") if k.strip())

    @property
    def failure_kind_set(self) -> frozenset[str]:
        return frozenset(k.strip() for k in self.failure_kinds.split(",") if k.strip())
