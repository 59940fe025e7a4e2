"""Incidents and plans: pure decisions, no I/O.

An incident is opened once per root cause: a diagnosis joins an open incident when it is
an update of one already linked, when it supersedes one (its anomalies overlap), or when
it names the same cause on overlapping hosts within the cooldown. A new incident gets a
plan: the policy's actions for its cause, adapted to what the job can take right now.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from trainguard.envelope import uuid7
from trainguard.schemas import Diagnosis, Incident

from .policy import Policy

RESTARTING = frozenset({"restart", "rollback", "isolate"})


@dataclass
class JobView:
    """What the remediator knows of a job when it decides."""

    hosts: dict[str, dict[str, Any]] = field(default_factory=dict)
    """host -> NodeHello fields (hosts_store, nnodes_min, ...), for hosts still in the job."""
    restarts_last_hour: int = 0
    cause_count_last_hour: int = 0
    first_seen_at: float | None = None
    """When this cause was first seen on these hosts (for "isolate if sustained")."""
    attempt: int | None = None
    last_step: int | None = None


@dataclass
class Step:
    action: str
    params: dict[str, Any] = field(default_factory=dict)
    status: str = "pending"  # pending, sent, done, failed, skipped
    command_ids: list[str] = field(default_factory=list)
    detail: str = ""
    at: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"action": self.action, "params": self.params, "status": self.status,
                "command_ids": self.command_ids, "detail": self.detail, "at": self.at}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Step:
        return cls(action=d["action"], params=dict(d.get("params", {})),
                   status=d.get("status", "pending"), command_ids=list(d.get("command_ids", [])),
                   detail=d.get("detail", ""), at=d.get("at"))


def find_incident(open_incidents: list[Incident], d: Diagnosis, cooldown_s: float,
                  now: float) -> Incident | None:
    """The open incident ``d`` belongs to, if any."""
    for inc in open_incidents:
        if d.id in inc.diagnosis_ids:
            return inc
    for inc in open_incidents:
        if set(d.anomaly_ids) & set(inc.anomaly_ids):
            return inc
    for inc in open_incidents:
        recent = inc.detected_at is None or now - (inc.detected_at or now) <= cooldown_s
        if inc.cause == d.cause and recent and (not d.hosts or not inc.hosts
                                                 or set(d.hosts) & set(inc.hosts)):
            return inc
    return None


def open_incident(d: Diagnosis, detected_at: float | None, now: float) -> Incident:
    return Incident(id=uuid7(), job=d.job, cause=d.cause, status="open", rev=0,
                    ranks=list(d.ranks),
                    hosts=list(d.hosts), diagnosis_ids=[d.id], anomaly_ids=list(d.anomaly_ids),
                    onset_at=d.onset_at, detected_at=detected_at or d.time or now,
                    diagnosed_at=d.time or now, failure_step=d.step, summary=d.summary)


def join(inc: Incident, d: Diagnosis) -> bool:
    """Merge ``d`` into ``inc``; True if the root cause changed (a re-plan is due)."""
    if d.id not in inc.diagnosis_ids:
        inc.diagnosis_ids.append(d.id)
    inc.anomaly_ids.extend(a for a in d.anomaly_ids if a not in inc.anomaly_ids)
    inc.ranks = sorted(set(inc.ranks) | set(d.ranks))
    changed = d.cause != inc.cause and d.status == "open" and d.cause != "unknown"
    if changed:
        inc.cause = d.cause
        inc.hosts = list(d.hosts)
        inc.summary = d.summary
    else:
        inc.hosts = sorted(set(inc.hosts) | set(d.hosts))
    if d.step is not None and (inc.failure_step is None or d.step > inc.failure_step):
        inc.failure_step = d.step
    return changed


def plan(inc: Incident, d: Diagnosis, policy: Policy, view: JobView,
         now: float | None = None) -> tuple[list[Step], list[str]]:
    """The steps to run for ``inc`` and notes on why the plan differs from the policy."""
    now = now or time.time()
    cp = policy.for_cause(inc.cause)
    notes: list[str] = []
    actions = list(cp.actions)
    if inc.cause == "unknown" and policy.escalate_unknown:
        return [Step("escalate", {"reason": "cause unknown", "grace": policy.unknown_grace_s})], \
            ["unknown cause: a human decides"]
    if cp.escalate_after and view.cause_count_last_hour >= cp.escalate_after:
        return [Step("escalate", {"reason": f"{inc.cause} {view.cause_count_last_hour} times "
                                            "in the last hour"})], ["repeating cause"]
    if cp.isolate_if_sustained_s and view.first_seen_at is not None \
            and now - view.first_seen_at >= cp.isolate_if_sustained_s and "isolate" not in actions:
        actions.append("isolate")
        notes.append(f"sustained {now - view.first_seen_at:.0f}s: isolating")
    if any(a in RESTARTING for a in actions) \
            and view.restarts_last_hour >= policy.restart_budget_per_hour:
        return [Step("escalate", {"reason": f"restart budget spent ({view.restarts_last_hour}/"
                                            f"{policy.restart_budget_per_hour} in the last "
                                            "hour)"})], ["budget spent"]
    steps: list[Step] = []
    for action in actions:
        if action == "none":
            continue
        if action == "save_now":
            if inc.cause in ("rank_hang", "network"):
                notes.append("save_now skipped: the collective is hung")
                continue
            steps.append(Step("save_now", {"deadline": policy.save_deadline_s}))
        elif action == "isolate":
            for host in inc.hosts:
                ok, why = can_isolate(host, view)
                if ok:
                    steps.append(Step("isolate", {"host": host}))
                else:
                    notes.append(f"not isolating {host}: {why}; restarting in place")
                    steps.append(Step("escalate", {"reason": f"{host} should leave the job "
                                                             f"but cannot: {why}"}))
        elif action == "dump":
            by_host: dict[str, list[int]] = {}
            for host in inc.hosts or [""]:
                by_host[host] = list(inc.ranks)
            for host, ranks in by_host.items():
                if host:
                    steps.append(Step("dump", {"host": host, "ranks": ranks}))
        elif action == "rollback":
            below = inc.failure_step if inc.failure_step is not None else 0
            steps.append(Step("rollback", {"below_step": below}))
        else:
            steps.append(Step(action, {}))
    if any(s.action in ("isolate", "rollback") for s in steps) \
            and not any(s.action == "restart" for s in steps):
        steps.append(Step("restart", {}))  # the job re-forms / reloads only on a restart
    # An escalation from a refused isolation must not stop the restart in place.
    if any(s.action == "escalate" for s in steps) and not any(
            s.action == "restart" for s in steps) and any(a in RESTARTING for a in actions):
        steps.append(Step("restart", {}))
    return steps, notes


def can_isolate(host: str, view: JobView) -> tuple[bool, str]:
    """Only when the job can go on without the host (elastic minimum still met) and the
    host does not run the rendezvous store."""
    info = view.hosts.get(host)
    if info is None:
        return False, "no agent registered for it"
    if info.get("hosts_store"):
        return False, "it runs the rendezvous store"
    remaining = len(view.hosts) - 1
    minimum = int(info.get("nnodes_min", 1))
    if remaining < max(1, minimum):
        return False, f"{remaining} node(s) would remain, below the job's minimum {minimum}"
    return True, ""


def resolved_by_progress(inc: Incident, view: JobView, restarted_attempt: int | None) -> bool:
    """Training passed the failure step again (in an attempt after the restart, if any)."""
    if view.last_step is None or inc.failure_step is None:
        return False
    if restarted_attempt is not None and (view.attempt is None or view.attempt <=
                                          restarted_attempt):
        return False
    return view.last_step > inc.failure_step
