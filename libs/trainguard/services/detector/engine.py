"""The detector as pure code: every job's state and rules, fed message by message.

:class:`Detector` is what the service wraps and what tests and the benchmark drive
directly with synthetic streams and a simulated clock. It does no I/O: anomalies go to
:attr:`Detector.outbox` (drained by the caller), progress is returned, and what a restart
needs comes back in through :meth:`Detector.restore`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

from trainguard.contract import envnames
from trainguard.contract.envelope import uuid7
from trainguard.contract.evidence import HangEvidence
from trainguard.contract.schemas import (
    Anomaly,
    CheckpointReport,
    Fingerprint,
    GpuSample,
    Heartbeat,
    NodeHeartbeat,
    NodeHello,
    RankHello,
    StepReport,
    TelemetryMessage,
    WorkerExit,
)
from trainguard.runtime.state import Progress

from .batches import BadBatches
from .book import AnomalyBook, Transition
from .hardware import GpuHealth
from .job import JobState
from .liveness import Liveness
from .numerics import Fingerprints, Numerics
from .performance import Checkpoints, DataStalls, Stragglers, Throughput
from .progress import seed, summarize
from .thresholds import Thresholds, with_job_overrides

LIVENESS = Liveness()
STRAGGLERS = Stragglers()


class JobRules:
    """The rules of one job that keep state of their own (baselines, rounds, counters)."""

    __slots__ = ("batches", "checkpoints", "data", "fingerprints", "gpu", "numerics",
                 "throughput")

    def __init__(self, job: JobState) -> None:
        self.numerics = Numerics(job)
        self.data = DataStalls(job)
        self.throughput = Throughput(job)
        self.checkpoints = Checkpoints(job)
        self.fingerprints = Fingerprints()
        self.gpu = GpuHealth(job)
        self.batches = BadBatches()
        job.step_rules = [STRAGGLERS, self.batches, self.numerics, self.data, self.throughput]


class Detector:
    """Per-job state and rules for every job this process owns.

    Args:
        thresholds: process-wide defaults; a job's hello may override them.
        clock: detector time (``time.time``; tests and the benchmark simulate it).
        new_id: anomaly id factory.
    """

    def __init__(self, thresholds: Thresholds, *, clock: Callable[[], float] = time.time,
                 new_id: Callable[[], str] = uuid7) -> None:
        self.base = thresholds
        self.clock = clock
        self.new_id = new_id
        self.jobs: dict[str, JobState] = {}
        self.rules: dict[str, JobRules] = {}
        self.outbox: list[Transition] = []
        self._overrides: dict[str, dict[str, str]] = {}

    # -- jobs ---------------------------------------------------------------------------
    def job(self, name: str) -> JobState:
        """The state of ``name``, created on first sight."""
        job = self.jobs.get(name)
        if job is None:
            job = self.jobs[name] = JobState(name, self.base,
                                             AnomalyBook(name, self.outbox, self.new_id),
                                             self.clock)
            self.rules[name] = JobRules(job)
        return job

    def forget(self, name: str) -> None:
        """Drop a job's in-memory state (it moved to another detector, or went idle)."""
        self.jobs.pop(name, None)
        self.rules.pop(name, None)
        self._overrides.pop(name, None)

    def grace(self, now: float, jobs: Iterable[str] | None = None) -> None:
        """No silence judgement for one ``hb_timeout``: we have not heard yet. A hang is
        judged inside it once every rank has been heard since (the view of that job is
        current: a detector that took a killed owner's job finds its hang as soon).

        Called while the detector's own view of the bus is stale and on the tick it is
        current again (every job: see :mod:`.busview`), and when it takes a job over (that
        job).
        """
        for name in self.jobs if jobs is None else jobs:
            job = self.jobs.get(name)
            if job is not None:
                job.judge_after = max(job.judge_after, now + job.th.hb_timeout)
                job.grace_from = now

    # -- messages -------------------------------------------------------------------------
    def on_telemetry(self, msg: TelemetryMessage) -> None:
        """One decoded telemetry message (the hot path: O(1) except at step boundaries)."""
        job = self.jobs.get(msg.job) or self.job(msg.job)
        if isinstance(msg, Heartbeat):
            job.on_heartbeat(msg)
        elif isinstance(msg, StepReport):
            job.on_step(msg)
        elif isinstance(msg, Fingerprint):
            if job.admit(msg.rank, msg.attempt, msg.time) is not None:
                rules = self.rules[msg.job]
                if rules.fingerprints.attempt != job.incarnation:
                    rules.fingerprints.reset(job.incarnation)
                rules.fingerprints.on_fingerprint(job, msg, self.clock())
        elif isinstance(msg, NodeHeartbeat):
            LIVENESS.on_node(job, msg, self.clock())
        elif isinstance(msg, GpuSample):
            self.rules[msg.job].gpu.on_sample(job, msg, self.clock())

    def on_hello(self, hello: RankHello, now: float) -> None:
        """A rank (re)started: its host, world size, GPU index and the job's overrides."""
        job = self.job(hello.job)
        job.saw_generation(hello.host, hello.attempt.generation)
        attempt = hello.attempt.restart_count
        r = job.admit(hello.rank, attempt, hello.time or now, hello.host, hello.world_size)
        if r is None:
            return
        if r.exited:
            job.revive(r, hello.time or now)  # a new process under the same attempt
        r.local_rank = hello.local_rank
        # A live process says hello again when its group goes on at another size: its next
        # step runs on a new mesh (compiled anew), like a new process's first step.
        r.formed_at = max(r.formed_at, hello.time or now)
        if job.current(r):
            job.set_world(hello.world_size, hello.time or now)
        # A rank's new process resumed from a checkpoint (or started afresh): the loss and
        # gradients it reports are not comparable with what came before.
        self.rules[hello.job].numerics.restart()
        env = {k: v for k, v in hello.env.items() if k.startswith(envnames.PREFIX)}
        if env and env != self._overrides.get(hello.job):
            self._overrides[hello.job] = env
            th, rejected = with_job_overrides(self.base, env)
            job.rejected_overrides = rejected
            if th != job.th:
                job.configure(th)
                self.rules[hello.job] = JobRules(job)

    def on_node_hello(self, hello: NodeHello, now: float) -> None:
        if hello.left:
            known = self.jobs.get(hello.job)
            if known is not None:
                known.launcher_changed(hello.host)
            return  # the launcher's goodbye: its ranks are gone, not to be admitted
        job = self.job(hello.job)
        job.launcher_changed(hello.host)  # a new launcher: its rendezvous may be new too
        for rank in hello.local_ranks:
            r = job.ranks.get(rank)
            if r is None:
                job.admit(rank, job.host_attempt.get(hello.host, job.attempt),
                          hello.time or now, hello.host)
            elif not r.host:
                r.host = hello.host

    def on_exit(self, ex: WorkerExit, now: float) -> None:
        LIVENESS.on_exit(self.job(ex.job), ex, now)

    def on_checkpoint(self, rep: CheckpointReport, now: float) -> None:
        job = self.job(rep.job)
        if job.admit(rep.rank, rep.attempt, rep.time or now) is not None:
            self.rules[rep.job].checkpoints.on_report(job, rep, now)

    # -- time ---------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Judge what only time reveals: silence, hangs, stalls, timeouts, resolutions."""
        for name, job in self.jobs.items():
            rules = self.rules[name]
            job.close_due(now)
            LIVENESS.tick(job, now)
            rules.checkpoints.tick(job, now)
            rules.fingerprints.tick(job, now)
            rules.gpu.tick(job, now)

    def progress(self, name: str, now: float) -> Progress | None:
        job = self.jobs.get(name)
        return summarize(job, now) if job is not None else None

    def drain(self) -> list[Transition]:
        """Anomaly changes since the last drain, in the order they happened."""
        out = self.outbox[:]
        self.outbox.clear()
        return out

    # -- restart ------------------------------------------------------------------------
    def restore(self, name: str, anomalies: Mapping[str, Anomaly], progress: Progress | None,
                now: float) -> None:
        """Take a job over from Redis: what is already open, and the last progress summary.

        Restored anomalies raise nothing; the rules resolve them when they see the job
        past them, exactly as if this process had raised them.
        """
        job = self.job(name)
        if progress is not None:
            seed(job, progress, now)
        for key, anomaly in anomalies.items():
            if anomaly.status != "open":
                continue
            job.book.restore(key, anomaly)
            if key == "hang" and isinstance(anomaly.evidence, HangEvidence):
                since = anomaly.evidence.stalled_since
                if since is not None:
                    job.last_progress = min(job.last_progress, since)
                    job.has_stepped = True
            elif key.startswith("straggler:"):
                rank = int(key.split(":", 1)[1])
                r = job.ranks.get(rank) or job.admit(rank, job.attempt, now)
                if r is not None:
                    r.straggling = True
        self.grace(now, [name])
