"""How an incident ends, and when a job must stop: pure, like :mod:`.engine`.

An incident is resolved once training passes its failure step (or its anomalies resolve),
escalated when that does not happen in time, and failed when the job cannot recover.

torchrun restarts a group whose worker died by itself, up to ``--max-restarts`` times (1000
under ``trainguard launch``): left alone, a rank that crashes on every start loops for
hours. So every worker group that ended in a failure no command caused counts against the
job's hourly restart budget, once, by its **generation** (the job-wide process-group
generation every host draws from the rendezvous, new at every group the launchers form
and at every rank replaced in place), so that one failure seen on several hosts, or a
failed group the remediator then restarts itself, counts once (:func:`exit_entry`,
:func:`attempt_member`). Worker exits carry it; the remediator's restarts count the one
the detector's progress names. A node's attempt (its own restart count) is no job-wide
number: hosts that joined later, or restarted alone, count differently. Once the budget
or the cause's ``escalate_after`` is spent, or every launcher of the job has exited, the
incident gets its last two steps (:func:`.engine.hold_steps`): ``escalate`` tells on-call,
once, with the failure's :func:`signature`, and ``hold`` stops every agent of the job
(``trainguard launch`` exits 80). The incident then fails (:func:`.engine.finish_step`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Final, Literal

from trainguard.contract.envelope import uuid7
from trainguard.contract.schemas import Diagnosis, Incident, NodeHello, WorkerExit
from trainguard.runtime.state import NodeRecord

from . import recovery
from .engine import (
    AGENT_ACTIONS,
    CRASHING,
    RESTARTING,
    JobView,
    Outcome,
    acted,
    budget_spent,
    hold_steps,
    is_open,
    repeating,
)
from .policy import Policy

HOUR: Final = 3600.0
ATTEMPT: Final = "generation:"
"""Budget entries of groups of a known generation are ``generation:<g>``; the rest are
unique."""
NODE_ATTEMPT: Final = "attempt:"
"""Exits of older agents, which carry no generation, count by their node's restart count
(``attempt:<n>``): never taken for a generation."""

Resolution = Literal["progress", "anomalies", "timeout"]
"""Why an incident ends: training passed the failure step, its anomalies resolved (for
incidents without a restart), or it was not resolved in time (escalated)."""


# -- the restart budget ------------------------------------------------------------------

def exit_entry(ex: WorkerExit, now: float) -> str | None:
    """The budget entry of the group ``ex`` ended, if it counts: a failure that no command
    caused (torchrun restarts the group for it, or gives up), within the last hour. Every
    exit of one generation, whichever host saw it, is the same entry, and the same one the
    remediator's restart of that group counts (:func:`attempt_member`)."""
    if ex.initiated_by or (ex.exit_code == 0 and not ex.signal):
        return None
    if ex.time and now - ex.time > HOUR:
        return None  # replayed history
    if not ex.generation:
        return f"{NODE_ATTEMPT}{ex.attempt}"  # an older agent: the best it can say
    return attempt_member(ex.generation)


def attempt_member(generation: int | None) -> str:
    """The budget entry of an ended group, by its generation; an unknown one (None, 0) is
    always a new entry."""
    if not generation:
        return f"restart:{uuid7()}"
    return f"{ATTEMPT}{generation}"


def attempt_of(member: str) -> int | None:
    """The generation a budget entry counts (None: an unknown or an older agent's)."""
    head, _, tail = member.partition(ATTEMPT)
    return int(tail) if not head and tail.isdigit() else None


# -- holding a job -----------------------------------------------------------------------

def exit_line(d: Diagnosis) -> str:
    """The exit's last stderr line (or the error text that named the cause) as the
    diagnoser quoted it; empty for a diagnosis without an exit."""
    return next((str(e.value) for e in d.evidence
                 if e.source == "exit" and isinstance(e.value, str) and e.value
                 and e.fact != "traceback signature" and not e.fact.startswith("peer error")),
                "")


def signature(d: Diagnosis) -> str:
    """The failure as on-call reads it: cause, culprit rank(s) and host(s), the exit's last
    stderr line and the traceback's hash, e.g. ``process_crash: rank 1 on node-a:
    RuntimeError: bad batch [traceback 3f2a9c01b7de]``."""
    who = f"rank{'s' if len(d.ranks) != 1 else ''} {', '.join(map(str, d.ranks))}" \
        if d.ranks else "the job"
    if d.hosts:
        who += f" on {', '.join(d.hosts)}"
    traceback = next((str(e.value) for e in d.evidence if e.fact == "traceback signature"
                      and e.value), "")
    parts = [d.cause, who, exit_line(d)]
    return ": ".join(p for p in parts if p) + (f" [traceback {traceback}]" if traceback else "")


def sign(inc: Incident, d: Diagnosis) -> None:
    """Keep the newest signature of ``inc``'s cause, preferring one with an exit line."""
    if d.cause == inc.cause and (exit_line(d) or not inc.signature):
        inc.signature = signature(d)


# -- node records ------------------------------------------------------------------------

def supersedes(hello: NodeHello, current: NodeRecord | None) -> bool:
    """Whether ``hello`` replaces the host's stored record: it is the newest by its sender's
    time (both come from the same host's clock), and a ``left`` wins a tie. So a hello that
    JetStream redelivers after the launcher's ``left`` never brings the host back, and a
    launcher started again on the host (a later time) does."""
    if current is None:
        return True
    return hello.time > current.time or (hello.time == current.time and hello.left)


def in_job(record: NodeRecord, blocked: Collection[str]) -> bool:
    """A stored record counts as a host of the job: its launcher has not left (a ``left``
    record stays a while as a tombstone, see :func:`supersedes`) and it is not blocklisted."""
    return not record.left and record.host not in blocked


def launcher_exited(inc: Incident, view: JobView) -> bool:
    """Every launcher of the job has exited (each announces it with a ``left`` hello, and
    the control plane drops its node record) while ``inc`` was open: nothing is left that
    could recover. Only for an incident a
    launcher took part in (a crash an agent reported, or a command an agent carried out),
    so a job run without ``trainguard launch`` never looks like one whose launchers left."""
    if not is_open(inc) or view.hosts:
        return False
    return inc.cause in CRASHING or any(s.action in AGENT_ACTIONS and s.status == "done"
                                        for s in inc.actions)


def hold_reason(inc: Incident, view: JobView, policy: Policy) -> str | None:
    """Why ``inc``'s job must stop now, if it must: its launchers are gone, or it is being
    restarted (by the remediator or by torchrun) past the hourly budget or while its cause
    repeats ``escalate_after`` times. Every restart that happened is counted by now, so the
    budget is spent only past it (a plan, before the restart it needs, counts that one)."""
    if not is_open(inc) or any(s.action == "hold" for s in inc.actions):
        return None
    if launcher_exited(inc, view):
        return "every launcher of the job has exited"
    if inc.cause not in CRASHING and not any(s.action in RESTARTING and acted(s)
                                             for s in inc.actions):
        return None  # nothing restarts this job: nothing loops
    if view.restarts_last_hour > policy.restart_budget_per_hour:
        return budget_spent(view, policy)
    after = policy.for_cause(inc.cause).escalate_after
    if after and view.cause_count_last_hour >= after:
        return repeating(inc, view, after)
    return None


def moot(inc: Incident, view: JobView, kind: str) -> Outcome | None:
    """A restart or hold of a job whose launchers have all exited is skipped: nobody is left
    to carry it out, or to acknowledge it."""
    if not launcher_exited(inc, view):
        return None
    return Outcome("skipped", f"nothing to {kind}: every launcher of the job has exited")


# -- resolution --------------------------------------------------------------------------

def resolved_by_progress(inc: Incident, view: JobView, restarted_attempt: int | None) -> bool:
    """Training passed the failure step again (in an attempt after the restart, if any);
    any step, for a failure before the first one."""
    if view.last_step is None:
        return False
    if restarted_attempt is not None and (view.attempt is None or view.attempt <=
                                          restarted_attempt):
        return False
    return inc.failure_step is None or view.last_step > inc.failure_step


def resolution(inc: Incident, view: JobView, resolved_anomalies: Collection[str],
               policy: Policy, now: float) -> Resolution | None:
    """Whether an incident whose steps have run ends now, and why.

    A restart, rollback or isolation that was only observed restarted nothing: the
    incident ends when the job recovers by itself (training passes the failure step, as
    after torchrun's own restart, or its anomalies resolve), else it escalates at the
    timeout (nobody recovered it)."""
    restarting = any(s.action in RESTARTING and acted(s) for s in inc.actions)
    if not restarting and observed_only(inc) and inc.failure_step is not None \
            and resolved_by_progress(inc, view, None):
        return "progress"
    if restarting and (recovery.resolved_in_place(inc, view, now) if recovery.in_place(inc)
                       else resolved_by_progress(inc, view, inc.restarted_attempt)):
        return "progress"
    if not restarting and (set(inc.anomaly_ids) <= set(resolved_anomalies)
                           or (inc.mitigated_at is not None and not inc.anomaly_ids)):
        return "anomalies"
    if now - (inc.detected_at or now) > policy.resolve_timeout_s:
        return "timeout"
    return None


@dataclass(frozen=True)
class Review:
    """What the watch of an open incident whose steps have run decides (:func:`review`)."""

    resolution: Resolution | None = None
    """The incident ends now, so: :func:`settle` it."""
    resume: bool = False
    """Ask the coordinator where training resumed first (:func:`needs_resume_step`)."""
    hold: str | None = None
    """Why its job must stop: the hold steps were added to it (run them)."""
    save: bool = False
    """Save it as a new revision (ended, given the hold steps, or a recovery noted)."""


def review(inc: Incident, view: JobView, resolved_anomalies: Collection[str],
           policy: Policy, now: float) -> Review:
    """Whether ``inc`` ends now (:func:`resolution`), or its job must be held
    (:func:`hold_reason`: its last two steps are added); either way the newest recovery
    report is noted on it (:func:`.recovery.apply`)."""
    noted = recovery.apply(inc, view.recoveries)
    why = resolution(inc, view, resolved_anomalies, policy, now)
    if why is not None:
        return Review(why, needs_resume_step(inc, why), save=True)
    reason = hold_reason(inc, view, policy)
    if reason is None:
        return Review(save=noted)  # which path ran, and why: a revision of its own
    inc.actions.extend(hold_steps(inc, reason))
    return Review(hold=reason, save=True)


def observed_only(inc: Incident) -> bool:
    """Some step of ``inc`` was observed, not carried out (its job was in observe mode)."""
    return any(s.status == "observed" for s in inc.actions)


def needs_resume_step(inc: Incident, why: Resolution) -> bool:
    """Steps lost are counted for a job the remediator restarted: from where it resumed,
    asked of the coordinator unless the restarted group said which step it loaded."""
    return why == "progress" and inc.restarted_attempt is not None \
        and not recovery.in_place(inc) and recovery.loaded_step(inc) is None


def settle(inc: Incident, why: Resolution, policy: Policy, now: float,
           resume_step: int | None = None) -> None:
    """End ``inc`` as :func:`resolution` decided; ``resume_step``: where training resumed."""
    if why == "timeout":
        inc.status = "escalated"
        inc.escalation = f"not resolved within {policy.resolve_timeout_s:.0f}s of detection"
        return
    inc.status, inc.resolved_at = "resolved", now
    recovery.settle_note(inc, now)
    if why == "progress" and resume_step is not None:
        inc.resume_step = resume_step
        if inc.failure_step is not None:
            inc.steps_lost = max(0, inc.failure_step - resume_step)
