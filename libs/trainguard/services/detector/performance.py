"""Straggler, throughput drop, data-loader stall and slow checkpoints.

All four compare a job with itself: ranks against the job's median at the same step
(stragglers, stalls), or recent steps against the job's own baseline (throughput,
checkpoints). Nothing is judged on absolute numbers, because every model and cluster
has its own.

Stragglers are found from compute time, not total step time: synchronous training makes
every rank's step as long as the slowest one's, and the difference hides in how long
each rank then waits in the collective. Compute = step time minus the comm phases (and
minus the phases that are long by nature, which every rank pays alike).
"""

from __future__ import annotations

from collections import deque

from trainguard.contract.evidence import (
    CheckpointSlowEvidence,
    DataStallEvidence,
    StragglerEvidence,
    StragglerThresholds,
    ThroughputDropEvidence,
)
from trainguard.contract.schemas import CheckpointReport

from .job import JobState, RankInfo, StepBucket
from .windows import ROBUST_SIGMA, FlagHistory, Ring, median, median_mad


def straggler_key(rank: int) -> str:
    return f"straggler:{rank}"


class Stragglers:
    """Per rank: compute above ratio x median and a robust z-score, ``patience`` of ``window``."""

    @staticmethod
    def onset(r: RankInfo, b: StepBucket) -> float:
        """When the slowness began: the first flagged step of the window, as a time."""
        return r.straggle_since if r.straggle_since is not None else b.first_time

    def on_step(self, job: JobState, b: StepBucket, now: float) -> None:
        th = job.th
        compute = b.compute
        if len(compute) < th.straggler_min_ranks:
            return
        med, mad = median_mad(list(compute.values()))
        if med <= 0.0:
            return
        sigma = max(ROBUST_SIGMA * mad, th.straggler_min_spread * med)
        threshold = max(th.straggler_ratio * med, med + th.straggler_z * sigma)
        patience = th.straggler_patience
        calm = th.straggler_window - patience
        ranks = job.ranks
        for rank, c in compute.items():
            r = ranks[rank]
            hist = r.straggle
            flagged = c > threshold
            hist.push(flagged)
            r.compute_recent.append(c)
            if flagged:
                if r.straggle_since is None:
                    r.straggle_since = b.first_time
            elif hist.count == 0:
                r.straggle_since = None
            if r.straggling:
                if hist.full and hist.count <= calm:
                    r.straggling = False
                    job.book.clear(straggler_key(rank), now, resolved_ratio=round(
                        median(list(r.compute_recent)) / med, 3))
            elif hist.count >= patience:
                r.straggling = True
                mine = median(list(r.compute_recent))
                job.book.raise_(
                    straggler_key(rank), "straggler", now=now, onset_at=self.onset(r, b),
                    ranks=[rank], hosts=[r.host], step=b.step, severity="warning",
                    evidence=StragglerEvidence(
                        compute=round(c, 6), rank_compute_median=round(mine, 6),
                        job_compute_median=round(med, 6), ratio=round(mine / med, 3),
                        z=round((c - med) / sigma, 2), mad=mad, flagged_steps=hist.count,
                        window=th.straggler_window,
                        step_time_median=round(median(b.durations), 6),
                        ranks_reporting=len(compute),
                        thresholds=StragglerThresholds(straggler_ratio=th.straggler_ratio,
                                                       straggler_z=th.straggler_z,
                                                       straggler_patience=patience)))


class DataStalls:
    """A rank whose data phase takes ``data_stall_ratio`` x the job's usual data time."""

    def __init__(self, job: JobState) -> None:
        th = job.th
        self.baseline = Ring(th.numeric_window)
        self.history = FlagHistory(th.data_stall_window)
        self.stalled: dict[int, float] = {}

    def on_step(self, job: JobState, b: StepBucket, now: float) -> None:
        th = job.th
        if not b.data:
            return
        usual = self.baseline.median()
        step_median = median(list(b.data.values()))
        self.baseline.add(step_median)
        if usual is None or len(self.baseline) < th.data_stall_window:
            return
        threshold = max(th.data_stall_floor, th.data_stall_ratio * usual)
        slow = {rank: d for rank, d in b.data.items() if d > threshold}
        self.history.push(bool(slow))
        self.stalled.update(slow)
        key = "data_stall"
        if self.history.count >= th.data_stall_patience:
            worst = sorted(self.stalled, key=lambda k: -self.stalled[k])[:th.evidence_max_ranks]
            job.book.raise_(key, "data_stall", now=now, onset_at=b.first_time,
                            ranks=worst, hosts=job.hosts_of(worst), step=b.step,
                            evidence=DataStallEvidence(
                                data_seconds={str(k): round(self.stalled[k], 4) for k in worst},
                                baseline_median=usual, threshold=threshold,
                                stalled_steps=self.history.count, window=th.data_stall_window,
                                data_stall_ratio=th.data_stall_ratio))
        elif self.history.count == 0:
            self.stalled.clear()
            job.book.clear(key, now)


class Throughput:
    """Per-rank throughput (tokens/s, else samples/s, else steps/s) against the baseline.

    The baseline stops learning while a drop is open, so a lasting slowdown stays an
    anomaly instead of quietly becoming the new normal.
    """

    def __init__(self, job: JobState) -> None:
        th = job.th
        self.baseline = Ring(th.throughput_window)
        self.recent = Ring(th.throughput_recent)
        self.times: deque[float] = deque(maxlen=th.throughput_recent)

    @property
    def onset(self) -> float:
        """Start of the recent window whose median fell: the drop began within it."""
        return self.times[len(self.times) // 2] if self.times else 0.0

    def on_step(self, job: JobState, b: StepBucket, now: float) -> None:
        th = job.th
        if b.index < th.throughput_warmup or not b.work:
            return
        rate = median(b.work)
        self.recent.add(rate)
        self.times.append(b.first_time)
        key = "throughput_drop"
        is_open = job.book.is_open(key)
        if not is_open:
            self.baseline.add(rate)
        if len(self.baseline) < th.throughput_min_baseline or not self.recent.full:
            return
        base = self.baseline.median()
        now_rate = self.recent.median()
        assert base is not None and now_rate is not None
        if base <= 0.0:
            return
        if now_rate < (1.0 - th.throughput_drop) * base:
            if is_open:
                return
            everyone = [r.rank for r in job.in_attempt()]
            job.book.raise_(key, "throughput_drop", now=now, onset_at=self.onset,
                            ranks=everyone, hosts=job.hosts_of(everyone), step=b.step,
                            evidence=ThroughputDropEvidence(
                                baseline=base, recent=now_rate, ratio=round(now_rate / base, 3),
                                throughput_drop=th.throughput_drop,
                                recent_steps=th.throughput_recent))
        elif is_open and now_rate >= (1.0 - th.throughput_drop / 2.0) * base:
            job.book.clear(key, now, recovered=now_rate)


class Checkpoints:
    """Saves slower than ``checkpoint_slow_ratio`` x the job's usual save.

    Three views of the same thing: ranks sitting in the checkpoint phase right now (from
    heartbeats, so a stuck save is caught while it lasts), the checkpoint phase durations
    of finished saves, and the shard reports, whose total includes asynchronous writes
    that the training loop never waits for.
    """

    def __init__(self, job: JobState) -> None:
        self.reports = Ring(64)
        self.report_step: int | None = None
        self.report_max = 0.0

    @staticmethod
    def _threshold(job: JobState, samples: list[float]) -> float | None:
        th = job.th
        if len(samples) < th.checkpoint_min_samples:
            return None
        return max(th.checkpoint_slow_floor, th.checkpoint_slow_ratio * median(samples))

    def _slow(self, job: JobState, now: float, seconds: float, threshold: float,
              usual: float, source: str, ranks: list[int], step: int | None) -> None:
        job.book.raise_("checkpoint_slow", "checkpoint_slow", now=now, onset_at=now - seconds,
                        ranks=ranks, hosts=job.hosts_of(ranks), step=step,
                        evidence=CheckpointSlowEvidence(
                            seconds=round(seconds, 3), usual=round(usual, 3),
                            threshold=round(threshold, 3), source=source,
                            checkpoint_slow_ratio=job.th.checkpoint_slow_ratio))

    def tick(self, job: JobState, now: float) -> None:
        th = job.th
        phase = th.checkpoint_phase
        ring = job.long_samples.get(phase)
        pending = [p for p in job.pending_long if p[0] == phase]
        job.pending_long.clear()
        # Baseline = samples from before this tick's finished saves.
        history = ring.values()[: max(0, len(ring) - len(pending))] if ring is not None else []
        threshold = self._threshold(job, history)
        census = job.census
        slow = False
        if threshold is not None:
            usual = median(history)
            for _, seconds, rank, _t in pending:
                if seconds > threshold:
                    slow = True
                    self._slow(job, now, seconds, threshold, usual, "phase", [rank],
                               job.max_step)
            if census is not None and census.majority == phase:
                inside = [r for r in census.live if r.phase == phase and r.phase_start]
                elapsed = now - min((r.phase_start or now for r in inside), default=now)
                if elapsed > threshold:
                    slow = True
                    ranks = [r.rank for r in inside][: th.evidence_max_ranks]
                    self._slow(job, now, elapsed, threshold, usual, "heartbeat", ranks,
                               job.max_step)
        if pending and not slow:
            job.book.clear("checkpoint_slow", now, next_save_seconds=pending[-1][1])

    def on_report(self, job: JobState, rep: CheckpointReport, now: float) -> None:
        if self.report_step is not None and rep.step < self.report_step:
            return
        if rep.step != self.report_step:
            if self.report_step is not None:
                self.reports.add(self.report_max)
            self.report_step = rep.step
            self.report_max = 0.0
        self.report_max = max(self.report_max, rep.seconds_total)
        history = self.reports.values()
        threshold = self._threshold(job, history)
        if threshold is not None and rep.seconds_total > threshold:
            self._slow(job, now, rep.seconds_total, threshold, median(history), "report",
                       [rep.rank], rep.step)
            return
        current = job.book.get("checkpoint_slow")
        if current is not None and current.step is not None and current.step < rep.step:
            job.book.clear("checkpoint_slow", now, next_save_seconds=rep.seconds_total)
