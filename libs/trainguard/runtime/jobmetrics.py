"""The series worth alerting on: jobs, incidents, checkpoints, memory snapshots, leadership.

Each service creates the families it feeds on its own registry (the detector the job
series, the remediator the incident and leader series, the coordinator the checkpoint and
memory snapshot series); the names are spelled here once, because ``deploy/prometheus`` and
``deploy/grafana`` read them and a test checks that every name they use is exported.

Label cardinality is bounded: the job (label ``training_job``) goes through
:class:`JobLabels` (at most ``max_jobs`` distinct values per process, later ones read
``_other``; a job that is gone is removed), ``cause`` and ``phase`` are fixed
vocabularies, and no series carries a rank, a host or an incident id.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final, Literal, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from trainguard.contract.rpc import MemorySummary
from trainguard.contract.schemas import Incident, PreflightReport

from .state import Progress

JOB: Final = "training_job"
"""The job label. Not ``job``: Prometheus gives every scraped series a ``job`` label of its
own (the scrape job) and would rename ours ``exported_job``."""
OTHER: Final = "_other"
MAX_JOBS: Final = 200
Phase = Literal["detect", "mitigate", "recover"]
PHASES: Final = get_args(Phase)
PHASE_BUCKETS: Final = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600)
PREFLIGHT_BUCKETS: Final = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
"""Seconds: without DCGM a node's pre-flight takes seconds; ``dcgmi diag -r 3`` minutes."""
"""Seconds: detection takes seconds, recovery minutes; past an hour a human is involved."""
COMMIT_BUCKETS: Final = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
GOODPUT_WINDOW_S: Final = 600.0


class JobLabels:
    """The ``job`` label values this process exports: at most ``max_jobs``, then ``_other``.

    A runaway (a job name per run, thousands of runs) costs one series, not thousands;
    :meth:`forget` frees a value when the job is gone.
    """

    def __init__(self, max_jobs: int = MAX_JOBS) -> None:
        self.max_jobs = max_jobs
        self._known: set[str] = set()

    def __call__(self, job: str) -> str:
        if job in self._known:
            return job
        if len(self._known) >= self.max_jobs:
            return OTHER
        self._known.add(job)
        return job

    def forget(self, job: str) -> bool:
        """True when ``job`` had a series of its own (the caller removes it)."""
        if job in self._known:
            self._known.discard(job)
            return True
        return False


def phase_durations(inc: Incident) -> dict[Phase, float]:
    """How long each phase of ``inc`` took, for those whose ends are both known.

    detect: onset → detected; mitigate: detected → mitigated (the remediation ran);
    recover: mitigated → resolved (training passed the failure step again).
    """
    marks: dict[Phase, tuple[float | None, float | None]] = {
        "detect": (inc.onset_at, inc.detected_at),
        "mitigate": (inc.detected_at, inc.mitigated_at),
        "recover": (inc.mitigated_at, inc.resolved_at),
    }
    return {p: max(0.0, end - start) for p, (start, end) in marks.items()
            if start is not None and end is not None}


class IncidentMetrics:
    """The remediator's series: open incidents, phase durations, steps lost, leadership."""

    def __init__(self, registry: CollectorRegistry, role: str) -> None:
        self.jobs = JobLabels()
        self.role = role
        self.open = Gauge("trainguard_incidents_open", "Incidents not yet ended, by job and cause",
                          [JOB, "cause"], registry=registry)
        self.ended = Counter("trainguard_incidents_ended",
                             "Incidents that ended, by cause and how (resolved, escalated, "
                             "failed)", ["cause", "status"], registry=registry)
        self.phase = Histogram("trainguard_incident_phase_seconds",
                               "Time of each incident phase: detect (onset to detection), "
                               "mitigate (to the remediation done), recover (to training past "
                               "the failure)", ["cause", "phase"], buckets=PHASE_BUCKETS,
                               registry=registry)
        self.steps_lost = Counter("trainguard_steps_lost",
                                  "Training steps lost to incidents (re-done after a restart "
                                  "or rollback)", [JOB], registry=registry)
        self.leader = Gauge("trainguard_leader",
                            "1 while this replica leads its role, else 0", ["role"],
                            registry=registry)
        self.leader.labels(role).set(0)
        self._shown: set[tuple[str, str]] = set()

    def leading(self, yes: bool) -> None:
        self.leader.labels(self.role).set(1 if yes else 0)

    def show_open(self, incidents: Iterable[Incident]) -> None:
        """Set the open gauge from the full list of open incidents (the leader's view);
        label pairs no longer open are removed."""
        counts: dict[tuple[str, str], int] = {}
        for inc in incidents:
            key: tuple[str, str] = (self.jobs(inc.job), inc.cause)
            counts[key] = counts.get(key, 0) + 1
        for key in self._shown - counts.keys():
            self.open.remove(*key)
        for key, n in counts.items():
            self.open.labels(*key).set(n)
        self._shown = set(counts)

    def ended_incident(self, inc: Incident) -> None:
        """Count an incident that just ended (call once, when it ends)."""
        self.ended.labels(inc.cause, inc.status).inc()
        for phase, seconds in phase_durations(inc).items():
            self.phase.labels(inc.cause, phase).observe(seconds)
        if inc.steps_lost:
            self.steps_lost.labels(self.jobs(inc.job)).inc(inc.steps_lost)


class PreflightMetrics:
    """The remediator's pre-flight series: nodes checked by verdict, checks that failed or
    warned by kind (``nvml.ecc``, ``ib``: the name before its subject, a fixed vocabulary),
    and how long a node's checks took. Counted once per record (a redelivery is not a
    second node)."""

    SEEN: Final = 4096

    def __init__(self, registry: CollectorRegistry) -> None:
        self.nodes = Counter("trainguard_preflight_nodes", "Nodes' pre-flight records, by "
                             "verdict (ok, warn, fail) and trigger (launch, command, cli)",
                             ["status", "trigger"], registry=registry)
        self.checks = Counter("trainguard_preflight_checks",
                              "Pre-flight checks that failed or warned, by check and verdict",
                              ["check", "status"], registry=registry)
        self.seconds = Histogram("trainguard_preflight_seconds",
                                 "How long a node's pre-flight took", buckets=PREFLIGHT_BUCKETS,
                                 registry=registry)
        self._seen: deque[str] = deque(maxlen=self.SEEN)
        self._ids: set[str] = set()

    def observe(self, report: PreflightReport) -> None:
        if report.id in self._ids:
            return
        if len(self._seen) == self.SEEN:
            self._ids.discard(self._seen[0])
        self._seen.append(report.id)
        self._ids.add(report.id)
        self.nodes.labels(report.status, report.trigger).inc()
        for check in report.checks:
            if check.status in ("fail", "warn"):
                self.checks.labels(check.name.partition(":")[0], check.status).inc()
        if report.seconds > 0:
            self.seconds.observe(report.seconds)


@dataclass
class Goodput:
    """The share of wall time that moved training forward, over a sliding window.

    A sample's useful time is the steps it added beyond the highest step ever reached
    (steps re-done after a rollback or restart are not progress) times the typical step
    time; goodput is their sum over the window divided by the window's length, at most 1.
    A job that hangs, restarts or re-does lost steps drops towards 0.
    """

    window_s: float = GOODPUT_WINDOW_S
    high: int | None = None
    first: float | None = None
    samples: deque[tuple[float, float]] = field(default_factory=deque)

    def observe(self, now: float, last_step: int | None, step_time: float | None) -> float:
        if self.first is None:
            self.first = now
        useful = 0.0
        if last_step is not None:
            if self.high is not None and last_step > self.high and step_time:
                useful = (last_step - self.high) * step_time
            if self.high is None or last_step > self.high:
                self.high = last_step
        self.samples.append((now, useful))
        while self.samples and self.samples[0][0] <= now - self.window_s:
            self.samples.popleft()
        span = min(self.window_s, now - self.first)
        if span <= 0:
            return 1.0
        return min(1.0, sum(u for _, u in self.samples) / span)


class JobMetrics:
    """The detector's series about the jobs it owns, fed from each ``progress:<job>``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.jobs = JobLabels()
        self.last_step = Gauge("trainguard_job_last_step", "Newest step of the job's attempt",
                               [JOB], registry=registry)
        self.step_time = Gauge("trainguard_job_step_seconds", "Typical (median) step time",
                               [JOB], registry=registry)
        self.world = Gauge("trainguard_job_world_size", "Ranks in the job", [JOB],
                           registry=registry)
        self.goodput = Gauge("trainguard_job_goodput_ratio",
                             f"Share of the last {GOODPUT_WINDOW_S:g}s that moved training "
                             "past its highest step", [JOB], registry=registry)
        self._goodput: dict[str, Goodput] = {}

    def observe(self, progress: Progress, now: float | None = None) -> None:
        now = time.time() if now is None else now
        job = self.jobs(progress.job)
        if job == OTHER:
            return  # no meaningful value for a mix of jobs
        if progress.last_step is not None:
            self.last_step.labels(job).set(progress.last_step)
        if progress.median_step_time:
            self.step_time.labels(job).set(progress.median_step_time)
        self.world.labels(job).set(progress.world_size)
        tracker = self._goodput.setdefault(job, Goodput())
        self.goodput.labels(job).set(tracker.observe(now, progress.last_step,
                                                     progress.median_step_time))

    def forget(self, job: str) -> None:
        """The job is no longer ours: its series go (another detector exports them)."""
        if self.jobs.forget(job):
            for gauge in (self.last_step, self.step_time, self.world, self.goodput):
                with contextlib.suppress(KeyError):  # never set for this job
                    gauge.remove(job)
            self._goodput.pop(job, None)


class CheckpointMetrics:
    """The coordinator's series: the newest committed step and how long commits take."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.jobs = JobLabels()
        self.last_committed = Gauge("trainguard_checkpoint_last_committed_step",
                                    "Newest committed (not suspect) checkpoint step",
                                    [JOB], registry=registry)
        self.last_committed_time = Gauge("trainguard_checkpoint_last_committed_timestamp_seconds",
                                         "When the newest good checkpoint was committed",
                                         [JOB], registry=registry)
        self.latency = Histogram("trainguard_checkpoint_commit_seconds",
                                 "From the ranks' save to the commit", buckets=COMMIT_BUCKETS,
                                 registry=registry)
        self.closed = Counter("trainguard_checkpoints",
                              "Checkpoints closed, by outcome (committed, suspect, failed)",
                              ["status"], registry=registry)
        self._newest: dict[str, int] = {}

    def closed_checkpoint(self, job: str, step: int, status: str, started: float,
                          now: float) -> None:
        self.closed.labels(status).inc()
        if status != "committed":
            return
        if started > 0:
            self.latency.observe(max(0.0, now - started))
        label = self.jobs(job)
        if label == OTHER:
            return
        if step >= self._newest.get(label, -1):  # a late commit of an older step
            self._newest[label] = step
            self.last_committed.labels(label).set(step)
            self.last_committed_time.labels(label).set(now)


class MemorySnapshotMetrics:
    """The coordinator's series of the ranks' memory snapshots, from each job's summary
    (:class:`~trainguard.contract.rpc.MemorySummary`): how far back a rollback from memory
    reaches, and what the snapshots cost."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.jobs = JobLabels()
        self.age = Gauge("trainguard_memory_snapshot_age_seconds",
                         "Seconds since the newest step every rank holds a memory snapshot "
                         "of was taken", [JOB], registry=registry)
        self.step = Gauge("trainguard_memory_snapshot_step",
                          "The newest step every rank holds a memory snapshot of", [JOB],
                          registry=registry)
        self.copy = Gauge("trainguard_memory_snapshot_copy_seconds",
                          "What one memory snapshot's copy costs the training loop, on the "
                          "slowest rank", [JOB], registry=registry)
        self.host_bytes = Gauge("trainguard_memory_snapshot_host_bytes",
                                "Host memory the kept memory snapshots hold, on the rank "
                                "that holds the most", [JOB], registry=registry)

    def show(self, job: str, summary: MemorySummary | None) -> None:
        """Set the job's series from ``summary``; None removes them (no rank reports)."""
        if summary is None:
            if self.jobs.forget(job):
                for gauge in (self.age, self.step, self.copy, self.host_bytes):
                    with contextlib.suppress(KeyError):  # never set for this job
                        gauge.remove(job)
            return
        label = self.jobs(job)
        if label == OTHER:
            return  # no meaningful value for a mix of jobs
        self.age.labels(label).set(summary.age)
        self.step.labels(label).set(summary.newest_step)
        self.copy.labels(label).set(summary.copy_seconds)
        self.host_bytes.labels(label).set(summary.host_bytes)
