"""Every number the detection rules judge by, with its default and why it is that.

The same fields are settings of the detector process (``TRAINGUARD_HANG_FLOOR=8``, see
:class:`~.settings.DetectorSettings`) and can be overridden per job: a rank whose
``RankHello.env`` carries ``TRAINGUARD_HANG_FLOOR=30`` gets that job judged with a 30 s
floor, so a job with unusual steps does not need its own detector. Overrides that do not
parse are ignored with a note in :attr:`Thresholds.rejected`, never fatal: a typo in one
trainer's environment must not stop the detection of every job.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from trainguard.contract import envnames
from trainguard.runtime import xids

log = logging.getLogger("trainguard.detector")

ENV_PREFIX = envnames.PREFIX


@dataclasses.dataclass(frozen=True, kw_only=True)
class Thresholds:
    """Rule thresholds (seconds, ratios, step counts). Defaults suit steps of 0.1-10 s."""

    # -- liveness ------------------------------------------------------------------
    hb_timeout: float = 5.0
    """Heartbeat silence beyond this is ``unresponsive`` (5 x the client's 1 s beat)."""
    hang_floor: float = 1.0
    """No hang is declared before this much time without a completed step, where the job
    shows what it waits for: every rank heard inside the stall and most of them waiting in
    a collective. Raise it only for a job whose ranks wait that long by nature."""
    unclear_hang_floor: float = 5.0
    """The floor where the job does not show a wait: fewer than ``hang_learn_steps`` step
    intervals known, a rank not heard since the stall began, or no rank waiting in a
    collective (every rank busy in its own phase, e.g. a data refill)."""
    hang_k: float = 3.0
    """Hang limit = max(floor, hang_k x the rolling p99 step interval)."""
    hang_window: int = 200
    """Step intervals kept for the p99."""
    hang_learn_steps: int = 20
    """Step intervals needed before the p99 is trusted to say what a normal step is."""
    warmup_steps: int = 5
    """Steps at the start of each attempt left out of the step-time windows (compile)."""
    startup_grace: float = 300.0
    """Limit for an attempt that has not completed a step yet (loading, compiling)."""
    long_phases: str = "checkpoint,eval"
    """Phases that are long by nature: judged by limits learned for each of them."""
    long_phase_floor: float = 300.0
    """Limit for a long phase seen for the first time (nothing learned yet)."""
    comm_phases: str = "comm"
    """Phases that are collective wait, i.e. not a rank's own compute."""
    irregular_phases: str = "data"
    """Phases whose length varies by nature (a loader refilling, a remote read): a rank
    holding the job up in one is judged by the ``unclear_hang_floor``, not the
    ``hang_floor``, so a slow batch is not taken for a hang."""
    quiet_floor: float = 1.0
    """A rank held in an irregular phase whose process and its children (the loader's
    workers) did no work (no CPU, no I/O) for this long is stuck, not refilling: the
    ``hang_floor`` applies. Raise it for a loader that waits on storage whose first byte
    can take longer."""
    dstate_grace: float = 5.0
    """A rank must stay in D or t (traced) this long to be a hang; T counts at once."""
    restart_timeout: float = 60.0
    """An agent's "restarting" explains its ranks' silence for at most this long."""
    recovery_timeout: float = 90.0
    """A rank in the heartbeat phase ``recovering`` (its group re-forming in place) holds
    the hang judgement at most this long (the ranks give up after their 60 s
    ``rejoin_timeout``, and the agent then restarts the group)."""
    exit_max_age: float = 600.0
    """Worker exits older than this (replayed after an outage) update state, never alert."""
    exit_grace: float = 15.0
    """A rank that said it is closing holds the hang judgement this long while its exit
    report is on the way, so a crash is named as a crash and not as its peers' hang."""

    # -- stragglers ------------------------------------------------------------------
    straggler_ratio: float = 1.3
    """A step counts against a rank whose compute is this many times the job median..."""
    straggler_z: float = 3.5
    """...and whose robust z-score (median/MAD across ranks at that step) exceeds this."""
    straggler_min_spread: float = 0.02
    """Floor of the robust sigma, relative to the median, for very uniform jobs."""
    straggler_patience: int = 8
    """Flagged steps needed within the window (8 of 10): one slow step never alerts."""
    straggler_window: int = 10
    straggler_min_ranks: int = 3
    """Below this many reporting ranks a median says nothing about who is slow."""

    # -- numerics --------------------------------------------------------------------
    numeric_warmup: int = 50
    """Steps of baseline needed before explosions, vanishing or spikes are judged."""
    numeric_window: int = 200
    numeric_resolve_steps: int = 20
    """Consecutive normal steps that resolve a numeric anomaly."""
    grad_z: float = 6.0
    """Robust z-score of log(grad norm) against the baseline for explosion/vanishing."""
    grad_explosion_ratio: float = 10.0
    """An explosion must also be this many times the baseline median norm."""
    grad_vanishing_ratio: float = 100.0
    """Vanishing: this many times below the baseline median norm..."""
    grad_vanishing_steps: int = 3
    """...for this many consecutive steps."""
    loss_z: float = 6.0
    loss_spike_rel: float = 0.3
    """A spike must also exceed the baseline median by this fraction of it."""
    fp_wait: float = 5.0
    """Seconds to wait for missing fingerprints of a step before judging those present."""

    # -- throughput, data, checkpoints -------------------------------------------------
    throughput_warmup: int = 20
    throughput_window: int = 300
    throughput_recent: int = 20
    throughput_min_baseline: int = 50
    throughput_drop: float = 0.3
    """Alert when the recent median throughput is below (1 - this) x the baseline."""
    data_phase: str = "data"
    data_stall_floor: float = 1.0
    """Seconds of data wait in one step below which nothing is a stall."""
    data_stall_ratio: float = 10.0
    """A rank stalls when its data phase exceeds this x the job's median data time."""
    data_stall_patience: int = 3
    """Steps with a stalled rank needed within the last ``data_stall_window`` steps."""
    data_stall_window: int = 10
    checkpoint_phase: str = "checkpoint"
    checkpoint_slow_ratio: float = 2.0
    """A save is slow beyond this x the median of the job's earlier saves..."""
    checkpoint_slow_floor: float = 10.0
    """...and beyond this many seconds."""
    checkpoint_min_samples: int = 2

    # -- hardware ----------------------------------------------------------------------
    fatal_xids: str = ""
    """XIDs that are ``gpu_health``, comma-separated; empty: every XID NVIDIA's catalog says
    takes the GPU out of service (:func:`trainguard.runtime.xids.fatal_codes`)."""
    gpu_resolve_after: float = 300.0
    """A gpu_health anomaly resolves after this long without new fatal evidence."""

    # -- mechanics ---------------------------------------------------------------------
    bucket_timeout: float = 2.0
    """A step whose reports are incomplete is judged this long after its first report."""
    evidence_max_ranks: int = 256
    """Per-rank detail in evidence is capped (counts per phase are always complete)."""

    # -- parsed views (not settings) ---------------------------------------------------
    def phase_set(self, which: str) -> frozenset[str]:
        return frozenset(p.strip() for p in getattr(self, which).split(",") if p.strip())

    def xid_set(self) -> frozenset[int]:
        if not self.fatal_xids.strip():
            return xids.fatal_codes()
        return frozenset(int(x) for x in self.fatal_xids.split(",") if x.strip())


THRESHOLD_FIELDS: tuple[dataclasses.Field[Any], ...] = dataclasses.fields(Thresholds)
_NAMES = {f.name for f in THRESHOLD_FIELDS}


def thresholds_of(source: object) -> Thresholds:
    """The :class:`Thresholds` part of ``source`` (e.g. a ``DetectorSettings``)."""
    return Thresholds(**{f.name: getattr(source, f.name) for f in THRESHOLD_FIELDS})


def _coerce(value: str, default: object) -> object:
    if isinstance(default, bool):
        raise ValueError("no boolean thresholds")
    if isinstance(default, int):
        return int(value)
    if isinstance(default, float):
        number = float(value)
        if number != number or number < 0:
            raise ValueError("must be a non-negative number")
        return number
    return str(value)


def with_job_overrides(base: Thresholds, env: Mapping[str, str]) -> tuple[Thresholds, list[str]]:
    """``base`` with the ``TRAINGUARD_<FIELD>`` entries of a job's environment applied.

    Returns the thresholds and a list of rejected entries (with why) for the evidence and
    the log; unknown ``TRAINGUARD_*`` keys are the client's own settings and are skipped.
    """
    changes: dict[str, Any] = {}
    rejected: list[str] = []
    for key, raw in env.items():
        if not key.startswith(ENV_PREFIX):
            continue
        name = key[len(ENV_PREFIX):].lower()
        if name not in _NAMES:
            continue
        try:
            changes[name] = _coerce(raw, getattr(base, name))
        except ValueError as exc:
            rejected.append(f"{key}={raw!r}: {exc}")
    if rejected:
        log.warning("ignoring invalid per-job detector settings: %s", "; ".join(rejected))
    return (dataclasses.replace(base, **changes) if changes else base), rejected
