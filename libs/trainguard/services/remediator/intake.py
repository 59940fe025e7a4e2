"""What a diagnosis does to its job's incidents: pure, like :mod:`.engine` (the shell,
:mod:`.service`, loads, counts, saves and publishes).

The shell finds the incident a diagnosis belongs to (:func:`.engine.find_incident`), locks
it and loads what its last step saved; :func:`admit` then decides: the incident the
diagnosis opens or joins (:class:`Intake`). The shell carries that out in this order:
for a new incident, read the job's attempt and generation (the ones that failed); count
the diagnosis as an occurrence of its cause, so that the plan sees it; when the
incident's (new) root cause needs a plan, read the job's view and :func:`plan`; then save
the incident as a new revision, publish it and run its steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainguard.contract.schemas import Diagnosis, Incident

from .endings import sign
from .engine import JobView, detected_at, find_incident, is_open, join, open_incident, replan
from .policy import Policy


@dataclass(frozen=True)
class Intake:
    """The decision on one diagnosis."""

    incident: Incident | None
    """The incident it opens or joins, changed by it; None: nothing to do (a superseded
    diagnosis whose incident is gone: its successor carries the story)."""
    opened: bool = False
    """A new incident: the job's attempt now is the one that failed."""
    counted: bool = False
    """An occurrence of its cause (``causes:<job>:<cause>``, towards ``escalate_after``),
    counted before the plan reads the count: once per diagnosis, by its id."""
    replan: bool = False
    """The incident needs the plan of its (new) root cause: :func:`plan`."""


def admit(d: Diagnosis, candidate: Incident | None, cooldown_s: float,
          now: float) -> Intake:
    """Open an incident for ``d``, or join it to ``candidate`` (the incident found for it,
    as saved now) if that still takes it; a changed root cause of an open incident is
    re-planned. Either way the incident keeps ``d``'s signature of its cause."""
    inc = find_incident([candidate] if candidate is not None else [], d, cooldown_s, now)
    if inc is None:
        if d.status == "superseded":
            return Intake(None)
        inc = open_incident(d, detected_at(d, now), now)
        opened = again = True
    else:
        opened, again = False, join(inc, d) and is_open(inc)
    sign(inc, d)
    return Intake(inc, opened, d.status == "open", again)


def plan(admission: Intake, d: Diagnosis, policy: Policy, view: JobView, now: float,
         failed_in: int | None = None, failed_generation: int | None = None) -> None:
    """Give the admitted incident the plan for its cause, as the job is (``view``, read
    after the count); ``failed_in``, ``failed_generation``: a new incident's failure
    attempt and the process-group generation it ran in."""
    inc = admission.incident
    assert inc is not None, "nothing admitted"
    if admission.opened:
        inc.failure_attempt, inc.failure_generation = failed_in, failed_generation
    replan(inc, d, policy, view, now)
