"""What the ranks' and agents' recovery reports mean for an incident: pure, like
:mod:`.engine`.

A job recovers one of two ways (``RecoveryReport.path``): **in place** (the survivors kept
running, re-formed the group with a replacement at a new generation and handed it their
state, or every rank reloaded the committed checkpoint in-process), or by the **restart**
of every rank from the committed checkpoint. The agent reports that it replaced a rank in
place (the launcher's restart, done), the new group's lowest rank reports the recovery
once it runs again (source, resumed step, steps lost, seconds); an agent (or a rank)
reports why in place did not run when it falls back. The newest report after an incident's
onset tells the incident which path ran, why, the steps it lost and when the job was back
at work (:func:`apply`).

Survivors of an in-place recovery keep their attempt (torchrun's restart count), so the
attempt-based rules have a counterpart here: a crash whose rank was replaced in place is
"restarted by the launcher" (:func:`recovered_in_place`: no second restart), and the
incident resolves by progress of the re-formed group (:func:`resolved_in_place`: a step
at or past the one it resumed at, beyond the failure step).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final

from trainguard.contract.schemas import CommandAck, Incident, RecoveryNote, RecoveryReport

from .engine import JobView

SLACK_S: Final = 0.5
"""Reports up to this long before an incident's onset still belong to it: the onset is
the detector's reading (an exit's time, a stall's start) and clocks differ a little. No
more: the report of the previous failure's recovery (a rank replaced in place) must not
resolve a new failure that comes a second or two after it."""
ROLLBACK_CAUSES: Final = frozenset({"numeric", "sdc_suspect"})
RESIZE_WAIT_S: Final = 5.0
"""How long the restart that follows an isolation waits for the isolated agent's word that
the survivors re-form in place without it (sent as it leaves, before its ranks stop; a
job that cannot go on in place restarts as before, at most this much later)."""
GROUP_REPORT_WAIT_S: Final = 15.0
"""How long past detection an incident recovered in place waits for the re-formed group's
own report once training passed the failure on the agent's word alone."""


REGROUPED: Final = frozenset({"replace", "resize"})
"""Report kinds of a group that re-formed in place (a rank replaced, or a host gone)."""


RESUMED: Final = "resume"
"""The report of a restarted group that loaded a committed checkpoint: whatever the
incident, it says where the job came back (and what it could not load)."""


def _wanted_kinds(inc: Incident) -> frozenset[str]:
    rollback = inc.cause in ROLLBACK_CAUSES or any(s.action == "rollback" for s in inc.actions)
    if rollback:
        return frozenset({"rollback", RESUMED})
    if any(s.action == "isolate" for s in inc.actions):
        # the survivors go on without the host, or a rank was replaced
        return REGROUPED | {RESUMED}
    return frozenset({"replace", RESUMED})


def matching(inc: Incident, reports: Iterable[RecoveryReport]) -> RecoveryReport | None:
    """The newest report of the kind ``inc`` needs (a rollback, a rank replaced, the group
    gone on without an isolated host) made after its onset, if any."""
    since = inc.onset_at if inc.onset_at is not None else inc.detected_at
    if since is None:
        return None
    kinds = _wanted_kinds(inc)
    found = [r for r in reports if r.kind in kinds and r.time >= since - SLACK_S]
    return max(found, key=lambda r: (r.time, r.path == "in_place"), default=None)


def under_way(report: RecoveryReport) -> bool:
    """An agent's word that it replaced a rank in place, or that its host left and the
    group re-forms without it (no source rank yet): the launcher's restart is done, the
    group still re-forms."""
    return report.path == "in_place" and report.kind in REGROUPED \
        and report.source_rank is None


def note_of(report: RecoveryReport) -> RecoveryNote:
    """The incident's account of ``report``: steps and seconds once the job is back (a
    group re-formed in place, or a restarted one that loaded its checkpoint)."""
    back = (report.path == "in_place" and not under_way(report)) \
        or report.kind == RESUMED
    return RecoveryNote(
        path=report.path, kind=report.kind, reason=report.reason,
        generation=report.generation,
        resumed_step=report.resumed_step if back else None,
        steps_lost=report.steps_lost if back else None,
        seconds=report.seconds if back else None,
        back_at=report.time if back else None,
        phases=dict(report.phases) if back else {}, tier=report.tier,
        report_id=report.id)


def apply(inc: Incident, reports: Iterable[RecoveryReport]) -> bool:
    """Record on ``inc`` the recovery its newest matching report describes; True when that
    changed the incident (a new revision is due)."""
    reports = list(reports)
    report = matching(inc, reports)
    if report is None:
        return False
    agent = _agent_phases(report, reports)
    earlier = inc.recovery
    if earlier is not None and earlier.report_id == report.id:
        if agent == earlier.agent_phases:
            return False
        earlier.agent_phases = agent  # the agent's report came after the group's
        return True
    note = note_of(report)
    note.agent_phases = agent
    if report.kind == RESUMED and earlier is not None and earlier.kind != RESUMED \
            and earlier.path == "restart" and earlier.reason:
        note.reason = f"{earlier.reason}; {note.reason}"  # why it restarted, then how it came back
    inc.recovery = note
    return True


def _agent_phases(report: RecoveryReport, reports: list[RecoveryReport]) -> dict[str, float]:
    """The failed rank's agent's part of the re-form ``report`` tells of (its ``replace``
    report at the same generation), whichever of the two came first."""
    if report.path != "in_place" or under_way(report):
        return dict(report.phases) if under_way(report) else {}
    agent = next((r for r in reports if under_way(r) and r.phases
                  and r.generation == report.generation), None)
    return dict(agent.phases) if agent is not None else {}


def in_place(inc: Incident) -> bool:
    return inc.recovery is not None and inc.recovery.path == "in_place"


def isolated(inc: Incident) -> bool:
    """``inc`` took a host out of the job (its survivors may go on in place)."""
    return any(s.action == "isolate" and s.status == "done" for s in inc.actions)


def recovered_in_place(inc: Incident) -> bool:
    """The group of ``inc`` re-formed in place (a rank replaced, or the survivors went on
    without an isolated host): the restart it planned is done already."""
    return in_place(inc) and inc.recovery is not None and inc.recovery.kind in REGROUPED


def skip_detail(inc: Incident) -> str:
    note = inc.recovery
    if note is None:
        return ""
    if note.resumed_step is None:
        return f"{note.reason}; the group re-forms in place: no restart needed"
    seconds = f" in {note.seconds:.2f} s" if note.seconds is not None else ""
    lost = f", {note.steps_lost} step(s) lost" if note.steps_lost is not None else ""
    return (f"recovered in place{seconds}: generation {note.generation}, resumed at step "
            f"{note.resumed_step}{lost}; no restart needed")


def resolved_in_place(inc: Incident, view: JobView, now: float) -> bool:
    """Training of the re-formed group got to the step it resumed at and past the failure
    step (the survivors' attempt did not change, so the attempt cannot say so).

    On the agent's word alone (the group's own report, with the steps lost and the time
    back, is still on its way: step telemetry can outrun it) it waits up to
    :data:`GROUP_REPORT_WAIT_S` past detection, so the incident ends with those figures.
    """
    note = inc.recovery
    if note is None or view.last_step is None:
        return False
    if note.resumed_step is not None and view.last_step < note.resumed_step:
        return False
    if inc.failure_step is not None and view.last_step <= inc.failure_step:
        return False
    if note.path == "in_place" and note.kind in REGROUPED and note.resumed_step is None:
        return now - (inc.detected_at or now) >= GROUP_REPORT_WAIT_S
    return True


def loaded_step(inc: Incident) -> int | None:
    """The checkpoint step a restarted group loaded, by its own ``resume`` report."""
    note = inc.recovery
    if note is None or note.kind != RESUMED or note.resumed_step is None:
        return None
    return note.resumed_step - 1


def settle_note(inc: Incident, now: float) -> None:
    """On resolution: steps lost from the in-place report, or from the step a restarted
    group says it loaded (the coordinator's pointer, asked at resolution, may have moved
    on with the group's next commit); a cold recovery was back at work when training
    passed the failure (now)."""
    note = inc.recovery
    if note is None:
        return
    if note.back_at is None:
        note.back_at = now
    if note.path == "in_place":
        if note.resumed_step is not None:
            inc.resume_step = note.resumed_step
        if note.steps_lost is not None:
            inc.steps_lost = note.steps_lost
    elif (loaded := loaded_step(inc)) is not None:
        inc.resume_step = loaded
        if inc.failure_step is not None:
            inc.steps_lost = max(0, inc.failure_step - loaded)


# -- rollback in place ---------------------------------------------------------------------

def reload_responders(world_size: int) -> list[str]:
    """Every rank must answer a ``reload`` (it runs on all of them at one step)."""
    return [f"rank-{r}" for r in range(world_size)]


def reload_verdict(acks: Sequence[CommandAck], world_size: int) -> tuple[bool, str]:
    """Whether every rank reloaded the checkpoint in-process (then no process restarts),
    and what the acks said. A rank that failed it (a trainer without the handler), or did
    not answer, leaves the rollback to the restart of today."""
    done = {a.responder for a in acks if a.outcome == "done"}
    want = set(reload_responders(world_size))
    if world_size > 0 and want <= done:
        return True, f"every rank ({world_size}) reloaded in place"
    failed = sorted({f"{a.responder}: {a.outcome} {a.detail[:120]}".strip() for a in acks
                     if a.outcome != "done"})
    silent = sorted(want - {a.responder for a in acks})
    parts = [f"reload in place not done ({len(done & want)}/{world_size} ranks)"]
    if failed:
        parts.append("; ".join(failed))
    if silent:
        parts.append(f"no answer from {', '.join(silent[:8])}"
                     + (f" and {len(silent) - 8} more" if len(silent) > 8 else ""))
    return False, "; ".join(parts) + "; restarting the group"


RELOADED: Final = "reloaded_in_place"
"""The rollback step's param that says its ``reload`` was done by every rank."""


def rolled_back_in_place(inc: Incident) -> bool:
    """The incident's rollback reloaded in place on every rank: its restart is moot."""
    return any(s.action == "rollback" and s.status == "done" and s.params.get(RELOADED)
               for s in inc.actions)
