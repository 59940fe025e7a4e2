"""What the dashboard shows, as pure state: fed messages, read as JSON snapshots.

Per job: each rank's recent steps (compute time, so a straggler stands out although
synchronous training makes every rank's total step time equal) and where it is now (phase,
time in it, process state), the incidents with their timelines, the checkpoints committed,
and goodput. No I/O: :mod:`.feed` feeds it from the bus, :mod:`.server` serves it, tests
call it directly.
"""

from __future__ import annotations

import statistics
from collections import deque
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

STEPS_SHOWN: Final = 40
"""Columns of the heat map: the newest steps of each rank."""
STUCK_FLOOR: Final = 5.0
"""A rank in one phase this long (or 5 x the median step time, if longer) is stuck, or
waiting if that phase is a collective's."""
INCIDENTS_SHOWN: Final = 50
COMM_PHASES: Final = frozenset({"comm"})
"""Collective wait: a rank's own compute is its step time minus these (DDP ranks report
``comm`` from the communication hook)."""


@dataclass
class RankView:
    rank: int
    host: str = ""
    step: int | None = None
    phase: str | None = None
    phase_elapsed: float = 0.0
    state: str = ""
    """The agent's process state letter (R, S, T, D, ...), if an agent reports it."""
    seen: float = 0.0
    """Sender's clock of the newest heartbeat."""
    steps: deque[tuple[int, float, float]] = field(
        default_factory=lambda: deque(maxlen=STEPS_SHOWN))
    """(step, compute seconds, total seconds) of the newest steps."""


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


def compute_time(report: StepReport) -> float:
    """The rank's own work in a step: its duration without collective wait."""
    waits = sum(v for k, v in report.phases.items() if k in COMM_PHASES)
    return max(0.0, report.duration - waits) if report.duration else \
        sum(v for k, v in report.phases.items() if k not in COMM_PHASES)


class Board:
    """Every job seen on the bus; :meth:`snapshot` is what the page renders."""

    def __init__(self, only_job: str | None = None) -> None:
        self.only_job = only_job
        self.jobs: dict[str, JobView] = {}
        self.version = 0
        """Bumped on every change, so the server sends a snapshot only when there is news."""

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
            r.steps.append((msg.step, compute_time(msg), msg.duration))
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
        return {"time": now, "version": self.version,
                "jobs": [self._job_snapshot(v, now) for _, v in sorted(self.jobs.items())]}

    def _job_snapshot(self, view: JobView, now: float) -> dict[str, Any]:
        times = [c for r in view.ranks.values() for _, c, _ in r.steps]
        totals = [t for r in view.ranks.values() for _, _, t in r.steps if t]
        median_compute = statistics.median(times) if times else None
        median_step = statistics.median(totals) if totals else None
        stuck_after = max(STUCK_FLOOR, 5 * (median_step or 0))
        # Each cell against the median of the ranks at that step, as the detector judges
        # stragglers: a step that was slow for everyone (the first, a checkpoint) is not.
        at_step: dict[int, list[float]] = {}
        for r in view.ranks.values():
            for s, c, _ in r.steps:
                at_step.setdefault(s, []).append(c)
        medians = {s: statistics.median(cs) for s, cs in at_step.items()}

        def ratio_at(s: int, c: float) -> float | None:
            m = medians.get(s)
            return round(c / m, 2) if m else None

        ranks: list[dict[str, Any]] = []
        for rank in sorted(view.ranks):
            r = view.ranks[rank]
            own = [x for s, c, _ in r.steps if (x := ratio_at(s, c)) is not None]
            ratio = statistics.median(own) if own else None
            ranks.append({
                "rank": rank, "host": r.host, "step": r.step, "phase": r.phase,
                "phase_elapsed": round(r.phase_elapsed, 2), "state": r.state,
                # Stuck: long in its own work (or stopped). Long in a collective is waiting
                # for the stuck one, as the detector reads it too.
                "stuck": r.state in ("T", "t", "D") or (
                    r.phase_elapsed > stuck_after and r.phase not in COMM_PHASES),
                "waiting": r.phase in COMM_PHASES and r.phase_elapsed > stuck_after,
                "silent_for": round(max(0.0, view.newest - r.seen), 2) if r.seen else None,
                "ratio": round(ratio, 2) if ratio else None,
                "steps": [{"step": s, "compute": round(c, 4), "ratio": ratio_at(s, c)}
                          for s, c, _ in r.steps],
            })
        slow = [x for x in ranks if x["ratio"] and x["ratio"] >= 1.3]
        if slow:
            max(slow, key=lambda x: x["ratio"])["slowest"] = True
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
            "ranks": ranks,
        }

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


def to_json(snapshot: dict[str, Any]) -> bytes:
    return msgspec.json.encode(snapshot)
