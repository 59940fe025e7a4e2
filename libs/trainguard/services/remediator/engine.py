"""The remediator's decisions: pure functions of an incident, a job view, the policy and the
time (no I/O; :mod:`.service` is the shell that loads, sends, waits and saves).

An incident is opened once per root cause: a diagnosis joins an open incident when it is
an update of one already linked, when it supersedes one (its anomalies overlap), when it
names the same cause on overlapping hosts within the cooldown, or when it is the same
crash again (a crash loop, see :func:`find_incident`). A new incident gets a
plan: the policy's actions for its cause, adapted to what the job can take right now; a
changed root cause re-plans, keeping the steps already done. The steps then run in order
(:func:`next_step`, :func:`finish_step`) until none is left (:func:`conclude`). How an
incident ends (resolved, escalated, or failed: held) is :mod:`.endings`. The shell asks
:mod:`.intake` (a diagnosis) and :mod:`.conduct` (the steps), which decide with these.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, NamedTuple

import msgspec

from trainguard.contract.envelope import uuid7
from trainguard.contract.rpc import RollbackReply, SaveReply
from trainguard.contract.schemas import (
    Action,
    CommandAck,
    Diagnosis,
    Incident,
    IncidentStep,
    JobMode,
    RecoveryReport,
    StepStatus,
)
from trainguard.runtime.state import BlocklistEntry, NodeRecord

from .policy import Policy

RESTARTING: Final = frozenset({"restart", "rollback", "isolate"})
"""Actions after which the job comes back in a new attempt (resolution waits for it)."""
CRASHING: Final = frozenset({"process_crash", "oom", "hbm_ecc"})
"""Causes whose evidence is a dead worker (the launcher restarts those by itself)."""
OPEN: Final = frozenset({"open", "mitigating"})
AGENT_ACTIONS: Final = frozenset({"restart", "isolate", "dump", "hold"})
"""Steps the node agents carry out (a done one proves the job runs under ``launch``)."""
EVIDENCE_ACTIONS: Final = frozenset({"dump"})
"""Steps that gather evidence and recover nothing: one that failed (a rank gone before it
could dump) is kept on the incident, and the recovery after it goes on."""

@dataclass
class JobView:
    """What the remediator knows of a job when it decides."""

    hosts: dict[str, NodeRecord] = field(default_factory=dict)
    """host -> its agent's record, for hosts still in the job (not blocklisted)."""
    restarts_last_hour: int = 0
    """Attempts of the job that ended (a failure the launcher restarted, or a restart or
    isolation the remediator sent) in the last hour."""
    ended_attempts: frozenset[int] = frozenset()
    """Their generations, where known (one failure seen on several hosts, then restarted by
    the remediator, counts once)."""
    cause_count_last_hour: int = 0
    first_seen_at: float | None = None
    """When this cause was first seen on these hosts (for "isolate if sustained")."""
    attempt: int | None = None
    """The detector's incarnation of the job (how often it started over)."""
    generation: int | None = None
    """The job's current process-group generation (the detector's progress; None:
    unknown): the group a restart now ends, as the budget counts it."""
    last_step: int | None = None
    world_size: int = 0
    """The current group's world size (the detector's progress; 0: unknown)."""
    recoveries: tuple[RecoveryReport, ...] = ()
    """The job's recovery reports of the last hour (:mod:`.recovery`)."""


# -- incidents ---------------------------------------------------------------------------

def is_open(inc: Incident) -> bool:
    return inc.status in OPEN


def find_incident(incidents: list[Incident], d: Diagnosis, cooldown_s: float,
                  now: float) -> Incident | None:
    """The incident ``d`` belongs to, if any, among the job's ``incidents``: an open one, or
    one that failed within the cooldown (a late crash of the loop its hold ended).

    Besides updates and superseding diagnoses, the same cause on overlapping hosts joins
    within the cooldown, and a crash that did not get past the incident's failure step
    joins at any time: torchrun restarted the group into the same failure (a crash loop is
    one incident, and on-call hears of it once)."""
    if d.anomaly_ids and d.anomaly_ids[-1] in d.collateral:
        # The revision only adds a consequence of its failure (a throughput drop while the
        # rank straggles): it belongs to that failure's incident, even one that is over.
        for inc in incidents:
            if d.id in inc.diagnosis_ids:
                return inc
    if d.anomaly_ids:
        # Nothing new, only more evidence on anomalies an incident took (a flight-recorder
        # verdict delivered again after the recovery it named was done): that incident's,
        # even over; opened anew, it would act on the replacement of the rank it named.
        for inc in sorted(incidents, key=lambda i: not is_open(i)):
            if set(d.anomaly_ids) <= set(inc.anomaly_ids):
                return inc
    found = [i for i in incidents
             if is_open(i) or (i.status == "failed" and now - closed_at(i) <= cooldown_s)]
    for inc in found:
        if d.id in inc.diagnosis_ids:
            return inc
    for inc in found:
        if set(d.anomaly_ids) & set(inc.anomaly_ids):
            return inc
    for inc in found:
        recent = inc.detected_at is None or now - (inc.detected_at or now) <= cooldown_s
        same = inc.cause == d.cause and (not d.hosts or not inc.hosts
                                         or bool(set(d.hosts) & set(inc.hosts)))
        if same and (recent or not is_open(inc) or crashes_again(inc, d)):
            return inc
    return None


def crashes_again(inc: Incident, d: Diagnosis) -> bool:
    """``d`` is the launcher's restart of ``inc``'s job dying the same way, no further on."""
    return inc.cause in CRASHING and (d.step is None or (
        inc.failure_step is not None and d.step <= inc.failure_step))


def closed_at(inc: Incident) -> float:
    """When ``inc``'s last step started (its end, for a closed one)."""
    return max((s.at for s in inc.actions if s.at is not None), default=inc.detected_at or 0.0)


def detected_at(d: Diagnosis, now: float) -> float:
    """When a new incident's failure was detected: a revision of an older diagnosis that
    opens a new incident is a new failure, detected now."""
    return d.time if d.rev == 1 and d.time else now


def open_incident(d: Diagnosis, detected_at: float | None, now: float) -> Incident:
    return Incident(id=uuid7(), job=d.job, cause=d.cause, status="open", rev=0,
                    ranks=list(d.ranks),
                    hosts=list(d.hosts), diagnosis_ids=[d.id], anomaly_ids=list(d.anomaly_ids),
                    onset_at=d.onset_at, detected_at=detected_at or d.time or now,
                    diagnosed_at=d.time or now, failure_step=d.step, summary=d.summary,
                    domain=d.domain, worker_exited=d.worker_exited)


def join(inc: Incident, d: Diagnosis) -> bool:
    """Merge ``d`` into ``inc``; True if the root cause changed, or hosts lost together
    gained one (a re-plan is due)."""
    if d.id not in inc.diagnosis_ids:
        inc.diagnosis_ids.append(d.id)
    inc.anomaly_ids.extend(a for a in d.anomaly_ids if a not in inc.anomaly_ids)
    inc.ranks = sorted(set(inc.ranks) | set(d.ranks))
    inc.worker_exited = inc.worker_exited or d.worker_exited
    changed = d.cause != inc.cause and d.status == "open" and d.cause != "unknown"
    if changed:
        inc.cause = d.cause
        inc.hosts = list(d.hosts)
        inc.summary = d.summary
        inc.domain = d.domain
    else:
        wider = sorted(set(inc.hosts) | set(d.hosts))
        # A host lost late with its domain leaves the job too: its isolation is planned.
        changed = inc.cause == "hosts_lost" and d.status == "open" and wider != inc.hosts
        inc.hosts = wider
    if d.step is not None and (inc.failure_step is None or d.step > inc.failure_step):
        inc.failure_step = d.step
    return changed


# -- plans -------------------------------------------------------------------------------

def _step(action: str, **params: Any) -> IncidentStep:
    return IncidentStep(action=action, params=params)


def plan(inc: Incident, d: Diagnosis, policy: Policy, view: JobView,
         now: float | None = None) -> tuple[list[IncidentStep], list[str]]:
    """The steps to run for ``inc`` and notes on why the plan differs from the policy."""
    now = now or time.time()
    cp = policy.for_cause(inc.cause)
    notes: list[str] = []
    actions = list(cp.actions)
    if inc.cause == "unknown" and policy.escalate_unknown:
        return [_step("escalate", reason="cause unknown", grace=policy.unknown_grace_s)], \
            ["unknown cause: a human decides"]
    if cp.escalate_after and view.cause_count_last_hour >= cp.escalate_after:
        return hold_steps(inc, repeating(inc, view, cp.escalate_after)), ["repeating cause"]
    if cp.isolate_if_sustained_s and view.first_seen_at is not None \
            and now - view.first_seen_at >= cp.isolate_if_sustained_s and "isolate" not in actions:
        actions.append("isolate")
        notes.append(f"sustained {now - view.first_seen_at:.0f}s: isolating")
    if any(a in RESTARTING for a in actions) and over_budget(inc, view, policy):
        return hold_steps(inc, budget_spent(view, policy)), ["budget spent"]
    steps: list[IncidentStep] = []
    stays = False  # a host that should leave and cannot: only its culprit rank restarts
    for action in actions:
        if action == "none":
            continue
        if action == "save_now":
            if inc.cause in ("rank_hang", "network"):
                notes.append("save_now skipped: the collective is hung")
                continue
            steps.append(_step("save_now", deadline=policy.save_deadline_s))
        elif action == "isolate" and inc.cause == "hosts_lost":
            steps.extend(_lost_steps(inc, view, notes))
        elif action == "isolate":
            for host in inc.hosts:
                ok, why = can_isolate(host, view)
                if ok:
                    steps.append(_step("isolate", host=host))
                else:
                    stays = True
                    notes.append(f"not isolating {host}: {why}; restarting in place")
                    steps.append(_step("escalate", reason=f"{host} should leave the job "
                                                          f"but cannot: {why}"))
        elif action == "dump":
            hosts = [h for h in dict.fromkeys(inc.hosts) if h]
            if len(hosts) == 1:
                steps.append(_step("dump", host=hosts[0], ranks=list(inc.ranks)))
            elif hosts:
                # Every culprit's host at once: a step per host, one after another, would
                # hold the restart for the ack deadline twice per lost host (32: ~21 min).
                steps.append(_step("dump", hosts=hosts, ranks=list(inc.ranks)))
        elif action == "rollback":
            below = inc.failure_step if inc.failure_step is not None else 0
            steps.append(_step("rollback", below_step=below))
        elif action == "restart":
            steps.append(_restart_step(inc, stays))
        else:
            steps.append(_step(action))
    if any(s.action in ("isolate", "rollback") for s in steps) \
            and not any(s.action == "restart" for s in steps):
        steps.append(_step("restart"))  # the job re-forms / reloads only on a restart
    # An escalation from a refused isolation must not stop the restart in place.
    if any(s.action == "escalate" for s in steps) and not any(
            s.action == "restart" for s in steps) and any(a in RESTARTING for a in actions):
        steps.append(_restart_step(inc, stays))
    return steps, notes


def _restart_step(inc: Incident, stays: bool) -> IncidentStep:
    found = culprit(inc, stays=stays)
    if found is None:
        return _step("restart")
    rank, host = found
    return _step("restart", rank=rank, host=host, fallback="group")


def _lost_steps(inc: Incident, view: JobView, notes: list[str]) -> list[IncidentStep]:
    """Hosts lost together leave the job together: one ``isolate`` step for all those that
    can go (``hosts``; ``lost``: no agent there is expected to answer), an escalation for
    each that cannot (it runs the rendezvous store, or too few hosts would remain)."""
    steps: list[IncidentStep] = []
    isolated = {h for s in inc.actions if s.action == "isolate" and s.status == "done"
                for h in s.params.get("hosts", [])}
    going = [h for h in inc.hosts if h in view.hosts and h not in isolated]
    leaving = len(going)
    kept: list[str] = []
    for host in (h for h in inc.hosts if h not in isolated):
        ok, why = can_isolate(host, view, leaving) if host in view.hosts \
            else (True, "")  # no agent record: nothing to re-form, blocklisted all the same
        if ok:
            kept.append(host)
        else:
            notes.append(f"not isolating {host}: {why}")
            steps.append(_step("escalate", reason=f"{host} should leave the job but "
                                                  f"cannot: {why}"))
    if kept:
        steps.insert(0, _step("isolate", hosts=kept, lost=True, domain=inc.domain))
    return steps


def culprit(inc: Incident, *, stays: bool = False) -> tuple[int, str] | None:
    """The one rank (and its host) whose restart replaces that rank alone (in place when
    the job can take it, else the group restarts): a ``rank_hang``'s, or, where its host
    should leave the job and cannot (``stays``: it runs the rendezvous store) and the rank
    still runs, the rank the fault names. A GPU's fault is its one process's: a new
    process on it is what a restart of the whole group would give that GPU, and the other
    ranks keep theirs. A rank that ended is being replaced already (its agent's spare, or
    the launcher's restart, which the group's restart step waits for)."""
    if (inc.cause == "rank_hang" or (stays and not inc.worker_exited)) \
            and len(inc.ranks) == 1 and len(inc.hosts) == 1:
        return inc.ranks[0], inc.hosts[0]
    return None


def restarts_after(inc: Incident, view: JobView) -> int:
    """The job's restarts in the last hour once ``inc``'s failed attempt is counted (its
    exit may not have been yet; an unknown attempt counts as one more)."""
    known = inc.failure_generation is not None \
        and inc.failure_generation in view.ended_attempts
    return view.restarts_last_hour + (0 if known else 1)


def over_budget(inc: Incident, view: JobView, policy: Policy) -> bool:
    """More restarts than the hourly budget allows, counting the one ``inc`` needs."""
    return restarts_after(inc, view) > policy.restart_budget_per_hour


def budget_spent(view: JobView, policy: Policy) -> str:
    return (f"restart budget spent ({view.restarts_last_hour} restarts in the last hour, "
            f"budget {policy.restart_budget_per_hour})")


def repeating(inc: Incident, view: JobView, escalate_after: int) -> str:
    return (f"{inc.cause} {view.cause_count_last_hour} times in the last hour "
            f"(escalate_after {escalate_after})")


def hold_steps(inc: Incident, reason: str) -> list[IncidentStep]:
    """The end of a job that cannot recover: on-call is told once, with the failure's
    signature, then every agent stops its workers (``trainguard launch`` exits 80)."""
    failure = inc.signature or inc.summary or inc.cause
    return [_step("escalate", reason=f"holding the job: {reason}; failure: {failure}"),
            _step("hold", reason=reason)]


def can_isolate(host: str, view: JobView, leaving: int = 1) -> tuple[bool, str]:
    """Only when the job can go on without the host (elastic minimum still met, with
    ``leaving`` hosts going at once) and the host does not run the rendezvous store."""
    info = view.hosts.get(host)
    if info is None:
        return False, "no agent registered for it"
    if info.hosts_store:
        return False, "it runs the rendezvous store"
    remaining = len(view.hosts) - leaving
    if remaining < max(1, info.nnodes_min):
        return False, (f"{remaining} node(s) would remain, below the job's minimum "
                       f"{info.nnodes_min}")
    return True, ""


def _identity(step: IncidentStep) -> tuple[str, bytes]:
    return step.action, msgspec.json.encode(step.params, order="sorted")


def merge_plan(current: Sequence[IncidentStep],
               planned: Sequence[IncidentStep]) -> list[IncidentStep]:
    """A re-plan: the steps already done stay, then the new plan without what they did.
    Steps observed (not carried out) stay as the record of what was decided, and do not
    count as done: the new plan decides them again."""
    kept = [s for s in current if s.status in ("done", "observed")]
    did = {_identity(s) for s in kept if s.status == "done"}
    return kept + [s for s in planned if _identity(s) not in did]


# -- observe-only ------------------------------------------------------------------------

def observing(policy: Policy, job: JobMode | None) -> frozenset[str]:
    """The action kinds observed (decided, recorded and announced, not carried out) for a
    job now: its own mode when an operator set one, else the policy's ``[observe]``."""
    return (job if job is not None else policy.observe).observed()


def acted(step: IncidentStep) -> bool:
    """``step`` ran (it was not only observed), so its effects may be expected."""
    return step.status != "observed"


def replan(inc: Incident, d: Diagnosis, policy: Policy, view: JobView, now: float) -> None:
    """Give ``inc`` the plan for its (new) cause, noting in its summary why it differs."""
    steps, notes = plan(inc, d, policy, view, now)
    inc.actions = merge_plan(inc.actions, steps)
    if notes:
        inc.summary = f"{inc.summary} [{'; '.join(notes)}]".strip()


# -- running the steps -------------------------------------------------------------------

def next_step(inc: Incident) -> int | None:
    """The index of the step to run now: the first not finished (a ``sent`` one is re-sent)."""
    return next((i for i, s in enumerate(inc.actions) if s.status in ("pending", "sent")),
                None)


def grace_to_wait(step: IncidentStep) -> float:
    """Seconds an escalation still waits for a better diagnosis to supersede it (0: none)."""
    if step.action != "escalate" or step.params.get("waited"):
        return 0.0
    return float(step.params.get("grace") or 0.0)


def start_step(inc: Incident, step: IncidentStep, now: float) -> None:
    step.at = now
    if inc.first_action_at is None:
        inc.first_action_at = now
        inc.status = "mitigating"


def finish_step(inc: Incident, step: IncidentStep) -> None:
    """What a finished step means for its incident."""
    if step.action == "escalate":
        inc.escalation = step.detail  # a human is told; steps that can still help go on
    elif step.action == "hold" and step.status in ("done", "skipped"):
        inc.status = "failed"  # held, or nothing was left to hold: the job has ended
        inc.escalation = inc.escalation or step.detail
    elif step.status == "failed" and step.action not in EVIDENCE_ACTIONS:
        inc.status = "escalated"
        inc.escalation = f"{step.action} failed: {step.detail}"


def conclude(inc: Incident, now: float) -> bool:
    """No step left: the incident is mitigated, or escalated when nothing in its plan could
    recover it after an escalation. True when that changed the incident."""
    if inc.mitigated_at is not None or not inc.actions:
        return False
    inc.mitigated_at = now
    recovering = any(s.action in RESTARTING and s.status in ("done", "skipped", "observed")
                     for s in inc.actions)
    if inc.escalation and not recovering:
        inc.status = "escalated"
    return True


def blocklist_entry(inc: Incident, now: float, ttl: float = 0.0) -> BlocklistEntry:
    """The entry that isolates a host for ``inc``; ``ttl`` > 0: it ends by itself then."""
    return BlocklistEntry(reason=inc.summary or inc.cause, cause=inc.cause, job=inc.job,
                          incident=inc.id, time=now, expires=now + ttl if ttl > 0 else 0.0)


def waits_for_launcher(inc: Incident) -> bool:
    """A dead worker: torchrun restarts the group by itself, so a restart first gives it
    the chance rather than restarting a group that is already coming back. Only where a
    worker did end: an ECC error read from NVML leaves every worker running, and nothing
    would restart the group while the wait lasts."""
    return inc.cause in CRASHING and inc.failure_attempt is not None and inc.worker_exited


def launcher_restarted(inc: Incident, view: JobView) -> bool:
    """The job is in a later attempt than the one that failed: restarting is done."""
    return inc.failure_attempt is not None and view.attempt is not None \
        and view.attempt > inc.failure_attempt


def skip_restart(inc: Incident, step: IncidentStep, view: JobView) -> None:
    step.status = "skipped"
    step.detail = f"the launcher already restarted the workers (attempt {view.attempt})"
    inc.restarted_attempt = inc.failure_attempt


# -- outcomes ----------------------------------------------------------------------------

class Outcome(NamedTuple):
    status: StepStatus
    detail: str


class AckVerdict(NamedTuple):
    status: StepStatus
    detail: str
    retry: bool
    """Worth sending again (as a retry): no answer, or every responder failed."""


ACK_LINES: Final = 8
"""Acks (and silent hosts) a step's detail names one by one; past that it counts them.
A group's command is answered by every agent (2,048 at 16k ranks): one line each would
make the incident, saved and published on every revision, grow with the job."""


def answered_by(ack: CommandAck) -> str:
    """The host whose agent sent ``ack`` (agents answer as ``host-<host>``)."""
    return ack.responder.removeprefix("host-")


def acks_complete(acks: Sequence[CommandAck], hosts: Collection[str]) -> bool:
    """Every expected host answered (any answer, when no host is named)."""
    responders = {answered_by(a) for a in acks}
    return bool(acks) and set(hosts) <= responders


def named(items: Sequence[str], limit: int = ACK_LINES, sep: str = ", ") -> str:
    """The first ``limit`` of ``items``, then how many more."""
    shown = sep.join(items[:limit])
    return shown + (f"{sep}and {len(items) - limit} more" if len(items) > limit else "")


def _ack_line(a: CommandAck) -> str:
    return f"{a.responder}: {a.outcome} {a.detail[:200]}".strip()


def acks_detail(acks: Sequence[CommandAck], hosts: Sequence[str]) -> str:
    """What the acks say, one line each for a few; for many, the count of each outcome,
    the lines of those that did not succeed (a few) and the hosts not heard from."""
    if len(acks) <= ACK_LINES:
        return "; ".join(_ack_line(a) for a in acks)
    outcomes = collections.Counter(a.outcome for a in acks)
    counts = ", ".join(f"{n} {outcome}" for outcome, n in outcomes.most_common())
    heard = {answered_by(a) for a in acks}
    silent = [h for h in hosts if h not in heard]
    of = f"{len(heard & set(hosts))} of {len(hosts)}" if hosts else f"{len(heard)}"
    parts = [f"{of} agents answered: {counts}"]
    odd = [_ack_line(a) for a in acks if a.outcome != "done"]
    if odd:
        parts.append(named(odd, sep="; "))
    if silent:
        parts.append(f"no answer from {named(silent)}")
    return "; ".join(parts)


def ack_verdict(acks: Sequence[CommandAck], hosts: Sequence[str], kind: str,
                earlier: str = "") -> AckVerdict:
    """What the acks of one send mean for its step; ``earlier``: the detail of a previous
    send, kept when this one got no answer. A refusal is final. The detail is bounded
    (:func:`acks_detail`) however many agents answer."""
    if not acks:
        return AckVerdict("failed", earlier or f"no acknowledgement of {kind} from "
                                               f"{named(list(hosts))}", True)
    detail = acks_detail(acks, hosts)
    if any(a.outcome == "done" for a in acks):
        return AckVerdict("done", detail, False)
    return AckVerdict("failed", detail, not any(a.outcome == "refused" for a in acks))


def save_outcome(reply: SaveReply | None, error: str = "") -> Outcome:
    """A save-now that did not commit is skipped, not failed: the plan goes on without it."""
    if reply is None:
        return Outcome("skipped", error or "the coordinator has no checkpoint")
    return Outcome("done" if reply.ok else "skipped",
                   reply.reason or (f"committed step {reply.step}" if reply.ok
                                    else f"save {reply.status}"))


def rollback_outcome(reply: RollbackReply | None, error: str = "") -> Outcome:
    """A rollback without a checkpoint to go back to fails (the incident escalates), unless
    every rank holds a memory snapshot to go back to."""
    if reply is None:
        return Outcome("failed", error or "the coordinator has no checkpoint")
    if reply.step is None and reply.memory_step is not None:
        return Outcome("done", reply.reason or f"memory snapshots to step {reply.memory_step}")
    if reply.step is None:
        return Outcome("failed", reply.reason or "no checkpoint")
    return Outcome("done", f"resume pointer at step {reply.step}")


ACTION_STATUS: Final[dict[StepStatus, Literal["sent", "acked", "failed", "skipped",
                                               "observed"]]] = {
    "done": "acked", "failed": "failed", "skipped": "skipped", "pending": "sent",
    "sent": "sent", "observed": "observed"}


def action_event(inc: Incident, step: IncidentStep, now: float) -> Action:
    """The ``action`` event that tells alerting tools what a step did."""
    return Action(id=uuid7(), job=inc.job, action=step.action, incident_id=inc.id,
                  diagnosis_id=inc.diagnosis_ids[-1] if inc.diagnosis_ids else "",
                  command_ids=list(step.command_ids), detail=step.detail, time=now,
                  status=ACTION_STATUS[step.status])
