"""What the dashboard shows, as pure state: fed messages, read as JSON summaries.

Per job: each rank's recent steps (compute time, so a straggler stands out although
synchronous training makes every rank's total step time equal) and where it is now (phase,
time in it, process state), the incidents with their timelines, the checkpoints committed,
and goodput. No I/O: :mod:`.feed` feeds it from the bus, :mod:`.server` serves it, tests
call it directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from trainguard.contract.schemas import (
    CheckpointCommitted,
    Durable,
    Heartbeat,
    Incident,
    NodeHeartbeat,
    StepReport,
    TelemetryMessage,
)

from . import grouped
from .rankview import COMM_PHASES, STEPS_SHOWN, RankView, compute_time
from .stepmedians import StepMedians

Judgement = tuple[list[grouped.Judged], dict[int, float], float | None, float | None]
"""Ranks judged, each step's median compute, median compute and step time."""

__all__ = ["COMM_PHASES", "STEPS_SHOWN", "Board", "JobView", "RankView", "compute_time",
           "incident_row", "rank_row", "to_json"]

STUCK_FLOOR: Final = 5.0
"""A rank in one phase this long (or 5 x the median step time, if longer) is stuck, or
waiting if that phase is a collective's."""
INCIDENTS_SHOWN: Final = 50


@dataclass
class JobView:
    job: str
    ranks: dict[int, RankView] = field(default_factory=dict)
    incidents: dict[str, Incident] = field(default_factory=dict)
    checkpoints: dict[int, CheckpointCommitted] = field(default_factory=dict)
    first_seen: float | None = None
    """Sender's clock of the first telemetry: where goodput's wall time starts."""
    newest: float = 0.0
    completed: set[int] = field(default_factory=set)
    """Distinct steps completed by any rank (a re-run step after a restart counts once)."""
    medians: StepMedians = field(default_factory=StepMedians)


class Board:
    """Every job seen on the bus; :meth:`summary` is what the page renders."""

    def __init__(self, only_job: str | None = None) -> None:
        self.only_job = only_job
        self.jobs: dict[str, JobView] = {}
        self.version = 0
        """Bumped on every change, so the server sends a summary only when there is news."""
        self._judgement: dict[str, tuple[int, Judgement]] = {}

    def _job(self, job: str) -> JobView | None:
        if self.only_job and job != self.only_job:
            return None
        view = self.jobs.get(job)
        if view is None:
            view = self.jobs[job] = JobView(job)
        return view

    def _rank(self, view: JobView, rank: int) -> RankView:
        r = view.ranks.get(rank)
        if r is None:
            r = view.ranks[rank] = RankView(rank)
        return r

    # -- feeding -------------------------------------------------------------------------
    def telemetry(self, msg: TelemetryMessage) -> None:
        view = self._job(msg.job)
        if view is None:
            return
        view.first_seen = msg.time if view.first_seen is None else min(view.first_seen,
                                                                        msg.time)
        view.newest = max(view.newest, msg.time)
        if isinstance(msg, Heartbeat):
            r = self._rank(view, msg.rank)
            if msg.time >= r.seen:
                r.seen, r.host, r.phase = msg.time, msg.host or r.host, msg.phase
                r.phase_elapsed = msg.phase_elapsed
                if msg.step is not None:
                    r.step = msg.step
        elif isinstance(msg, StepReport):
            r = self._rank(view, msg.rank)
            if r.steps and msg.step <= r.steps[-1][0]:
                r.steps.clear()  # a restart went back to an earlier step
            compute = compute_time(msg)
            r.steps.append((msg.step, compute, msg.duration))
            view.medians.add(msg.step, compute, msg.duration)
            r.step = max(r.step or 0, msg.step)
            view.completed.add(msg.step)
        elif isinstance(msg, NodeHeartbeat):
            for rank, state in msg.ranks.items():
                self._rank(view, int(rank)).state = state
        else:
            return
        self.version += 1

    def event(self, event: Durable) -> None:
        job = getattr(event, "job", None)
        view = self._job(job) if isinstance(job, str) else None
        if view is None:
            return
        if isinstance(event, Incident):
            old = view.incidents.get(event.id)
            if old is None or event.rev >= old.rev:
                view.incidents[event.id] = event
        elif isinstance(event, CheckpointCommitted):
            view.checkpoints[event.step] = event
        else:
            return
        self.version += 1

    # -- reading -------------------------------------------------------------------------
    def snapshot(self, now: float) -> dict[str, Any]:
        """Every rank in full, each with its 40-step strip (``/api/state``): complete but
        megabytes at thousands of ranks; the page reads :meth:`summary` instead."""
        return {"time": now, "version": self.version,
                "jobs": [self._job_snapshot(v) for _, v in sorted(self.jobs.items())]}

    def summary(self, now: float, top: int = grouped.TOP_N) -> dict[str, Any]:
        """What the page shows, bounded whatever the world size: per job the header, the
        ``top`` outliers in full, the groups' aggregates (calm ones collapsed), incidents."""
        return {"time": now, "version": self.version,
                "jobs": [self._job_summary(v, top) for _, v in sorted(self.jobs.items())]}

    def cells(self, job: str) -> dict[str, Any] | None:
        """The heat map of ``job``: one character per rank, in rank order
        (:func:`.grouped.cell_code`); None if the board has no such job."""
        view = self.jobs.get(job)
        if view is None:
            return None
        judged = self._judged(view)[0]
        ranks = sorted(view.ranks)
        contiguous = ranks == list(range(ranks[0], ranks[0] + len(ranks))) if ranks else True
        return {"job": job, "version": self.version, "world": len(ranks),
                "first": ranks[0] if ranks else 0, "ranks": None if contiguous else ranks,
                "codes": grouped.cell_codes(judged)}

    def _judged(self, view: JobView) -> Judgement:
        """Each rank judged (in rank order) on its newest ``RATIO_STEPS`` steps, each step's
        median compute, and the median compute and step time of the newest steps; kept
        until the board changes (the summary and the heat map of one version share it)."""
        cached = self._judgement.get(view.job)
        if cached is not None and cached[0] == self.version:
            return cached[1]
        last = grouped.RATIO_STEPS
        medians = {s: m[0] for s, m in view.medians.read().items()}
        median_compute, median_step = view.medians.recent(last)
        stuck_after = max(STUCK_FLOOR, 5 * (median_step or 0))
        judged = [grouped.judge(r, grouped.rank_ratio(r, medians, last), stuck_after,
                                view.newest) for _, r in sorted(view.ranks.items())]
        out = (judged, medians, median_compute, median_step)
        self._judgement[view.job] = (self.version, out)
        return out

    def _header(self, view: JobView, median_compute: float | None,
                median_step: float | None) -> dict[str, Any]:
        incidents = sorted(view.incidents.values(), key=lambda i: i.detected_at or 0,
                           reverse=True)[:INCIDENTS_SHOWN]
        committed = sorted(s for s, c in view.checkpoints.items() if c.status == "committed")
        last_step = max((r.step for r in view.ranks.values() if r.step is not None),
                        default=None)
        return {
            "job": view.job, "world": len(view.ranks), "last_step": last_step,
            "median_step": round(median_step, 4) if median_step else None,
            "median_compute": round(median_compute, 4) if median_compute else None,
            "goodput": self.goodput(view, median_step),
            "checkpoints": committed[-20:],
            "last_checkpoint": committed[-1] if committed else None,
            "open_incidents": sum(i.status in ("open", "mitigating") for i in incidents),
            "incidents": [incident_row(i) for i in incidents],
        }

    def _job_snapshot(self, view: JobView) -> dict[str, Any]:
        judged, medians, median_compute, median_step = self._judged(view)
        ranks = [rank_row(j, medians) for j in judged]
        slow = [x for x in ranks if x["ratio"] and x["ratio"] >= grouped.SLOW_RATIO]
        if slow:
            max(slow, key=lambda x: x["ratio"])["slowest"] = True
        return {**self._header(view, median_compute, median_step), "ranks": ranks}

    def _job_summary(self, view: JobView, top: int) -> dict[str, Any]:
        judged, medians, median_compute, median_step = self._judged(view)
        rows = [rank_row(j, medians) for j in grouped.outliers(judged, top)]
        slow = [x for x in rows if x["ratio"] and x["ratio"] >= grouped.SLOW_RATIO]
        if slow:
            max(slow, key=lambda x: x["ratio"])["slowest"] = True
        shown, collapsed = grouped.groups(judged, grouped.group_of(view.incidents.values()))
        return {**self._header(view, median_compute, median_step), "top": rows,
                "groups": shown, "collapsed": collapsed,
                "hung": sum(j.stuck for j in judged),
                "stopped": sum(j.stopped for j in judged),
                "lost": sum(j.lost for j in judged),
                "slow": sum((j.ratio or 0) >= grouped.SLOW_RATIO for j in judged)}

    @staticmethod
    def goodput(view: JobView, median_step: float | None) -> float | None:
        """Productive time over wall time: distinct steps completed times the median step
        time, over the time the job has been seen (the demo's measure)."""
        if view.first_seen is None or not median_step:
            return None
        wall = view.newest - view.first_seen
        if wall <= 0:
            return None
        return round(min(1.0, len(view.completed) * median_step / wall), 3)


def incident_row(i: Incident) -> dict[str, Any]:
    """An incident as the timeline shows it: what, who, when, what was done."""
    def span(a: float | None, b: float | None) -> float | None:
        return round(b - a, 1) if a and b else None

    return {
        "id": i.id, "cause": i.cause, "status": i.status, "summary": i.summary,
        "ranks": i.ranks, "hosts": i.hosts, "escalation": i.escalation,
        "onset_at": i.onset_at, "detected_at": i.detected_at, "resolved_at": i.resolved_at,
        "detect_s": span(i.onset_at, i.detected_at),
        "mitigate_s": span(i.detected_at, i.mitigated_at),
        "recover_s": span(i.detected_at, i.resolved_at), "steps_lost": i.steps_lost,
        "actions": [{"action": a.action, "status": a.status, "at": a.at,
                     "detail": a.detail} for a in i.actions],
    }


def rank_row(j: grouped.Judged, medians: dict[int, float]) -> dict[str, Any]:
    """A rank as a row: where it is now and its step strip against each step's median."""
    r = j.view

    def ratio_at(s: int, c: float) -> float | None:
        m = medians.get(s)
        return round(c / m, 2) if m else None

    return {
        "rank": r.rank, "host": r.host, "step": r.step, "phase": r.phase,
        "phase_elapsed": round(r.phase_elapsed, 2), "state": r.state,
        "stuck": j.stuck or j.stopped, "waiting": j.waiting, "lost": j.lost,
        "ratio": j.ratio,
        "steps": [{"step": s, "compute": round(c, 4), "ratio": ratio_at(s, c)}
                  for s, c, _ in r.steps],
    }


def to_json(snapshot: dict[str, Any]) -> bytes:
    return msgspec.json.encode(snapshot)
