"""What a diagnosis does to its job's incidents (:mod:`services.remediator.intake`): pure
tables, no bus; the shell's side is in tests/integration/test_remediator_service.py."""

from __future__ import annotations

import pytest

from trainguard.contract.schemas import Diagnosis, EvidenceItem, Incident, IncidentStep
from trainguard.runtime.state import NodeRecord
from trainguard.services.remediator import intake
from trainguard.services.remediator.engine import JobView
from trainguard.services.remediator.policy import load_policy

NOW = 1_000_000.0
POLICY = load_policy()
COOLDOWN = POLICY.cooldown_s
HOSTS = {"node-a": NodeRecord(job="j", host="node-a", hosts_store=True, nnodes_min=1),
         "node-b": NodeRecord(job="j", host="node-b", nnodes_min=1)}
EXITED = EvidenceItem(fact="exit", source="exit", value="RuntimeError: bad batch")


def diag(cause: str = "process_crash", ident: str = "d2", anomalies: tuple[str, ...] = ("a2",),
         status: str = "open", host: str = "node-b", step: int = 120) -> Diagnosis:
    return Diagnosis(id=ident, job="j", anomaly_ids=list(anomalies), cause=cause,  # type: ignore[arg-type]
                     confidence=0.9, ranks=[3], hosts=[host], step=step, time=NOW - 2,
                     onset_at=NOW - 5, status=status, summary=f"{cause} on {host}",  # type: ignore[arg-type]
                     evidence=[EXITED])


def incident(status: str = "mitigating", cause: str = "process_crash",
             detected: float = NOW - 10, steps: tuple[tuple[str, str], ...] = (
                 ("restart", "pending"),)) -> Incident:
    return Incident(id="i1", job="j", cause=cause, status=status, rev=3,  # type: ignore[arg-type]
                    ranks=[3], hosts=["node-b"], diagnosis_ids=["d1"], anomaly_ids=["a1"],
                    detected_at=detected, failure_step=120, failure_attempt=4,
                    actions=[IncidentStep(action=a, status=s)  # type: ignore[arg-type]
                             for a, s in steps])


ADMIT = [
    # candidate, diagnosis: joined (else opened, or None: nothing), counted, re-planned, cause
    (None, diag(), "opened", True, True, "process_crash"),
    (None, diag(status="superseded"), None, False, False, None),  # its successor tells
    (incident(), diag(), "joined", True, False, "process_crash"),  # same cause, same host
    (incident(), diag(status="superseded", anomalies=("a1",)), "joined", False, False,
     "process_crash"),  # an update of what the incident took: not a recurrence
    (incident(), diag("hbm_ecc", anomalies=("a1", "a2")), "joined", True, True, "hbm_ecc"),
    (incident(), diag("unknown", anomalies=("a1", "a2")), "joined", True, False,
     "process_crash"),  # a guess never changes the root cause
    (incident("resolved"), diag("hbm_ecc", anomalies=("a1",)), "joined", True, False,
     "hbm_ecc"),  # over: more evidence on its anomaly joins, nothing is re-planned
    (incident("resolved"), diag("hbm_ecc"), "opened", True, True, "hbm_ecc"),  # not its own
    (incident(detected=NOW - COOLDOWN - 60, cause="network"), diag("network", host="node-b"),
     "opened", True, True, "network"),  # the same cause past the cooldown: a new failure
]


@pytest.mark.parametrize(("candidate", "d", "taken", "counted", "replan", "cause"), ADMIT)
def test_admit(candidate: Incident | None, d: Diagnosis, taken: str | None, counted: bool,
               replan: bool, cause: str | None) -> None:
    admission = intake.admit(d, candidate, COOLDOWN, NOW)
    inc = admission.incident
    if taken is None:
        assert inc is None and not (admission.opened or admission.counted or admission.replan)
        return
    assert inc is not None
    assert (inc is candidate) is (taken == "joined")
    assert admission.opened is (taken == "opened")
    assert (admission.counted, admission.replan, inc.cause) == (counted, replan, cause)
    assert d.id in inc.diagnosis_ids


def test_a_new_incident_is_detected_when_the_diagnosis_was_sent() -> None:
    inc = intake.admit(diag(), None, COOLDOWN, NOW).incident
    assert inc is not None
    assert (inc.status, inc.rev, inc.detected_at, inc.failure_step, inc.hosts) == (
        "open", 0, NOW - 2, 120, ["node-b"])
    assert inc.signature == "process_crash: rank 3 on node-b: RuntimeError: bad batch"


def test_a_new_incident_fails_in_the_attempt_read_before_its_plan() -> None:
    d = diag()
    admission = intake.admit(d, None, COOLDOWN, NOW)
    intake.plan(admission, d, POLICY, JobView(hosts=dict(HOSTS), attempt=5), NOW, failed_in=4)
    assert admission.incident is not None
    assert admission.incident.failure_attempt == 4  # not the view's: read before the count
    assert [s.action for s in admission.incident.actions] == ["restart"]


def test_a_new_root_cause_is_planned_after_the_steps_already_done() -> None:
    inc = incident(steps=(("restart", "done"),))
    d = diag("hbm_ecc", anomalies=("a1", "a2"))
    admission = intake.admit(d, inc, COOLDOWN, NOW)
    intake.plan(admission, d, POLICY, JobView(hosts=dict(HOSTS), attempt=7), NOW, failed_in=7)
    assert inc.failure_attempt == 4  # a joined incident keeps its failure attempt
    assert [(s.action, s.status) for s in inc.actions] == [
        ("restart", "done"), ("isolate", "pending")]
    assert inc.signature.startswith("hbm_ecc: rank 3 on node-b")


def test_the_plan_sees_the_cause_counted() -> None:
    """The shell counts the diagnosis before it reads the view the plan is made from, so
    the diagnosis that reaches ``escalate_after`` is the one that holds the job."""
    d = diag("oom")
    admission = intake.admit(d, None, COOLDOWN, NOW)
    after = POLICY.for_cause("oom").escalate_after
    intake.plan(admission, d, POLICY, JobView(hosts=dict(HOSTS), cause_count_last_hour=after),
                NOW)
    assert admission.incident is not None
    assert [s.action for s in admission.incident.actions] == ["escalate", "hold"]
