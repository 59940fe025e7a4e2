"""Hosts lost together: one incident, one plan that isolates them in one step, then one
restart (pure rules: intake, plan, the step's act)."""

from __future__ import annotations

from trainguard.contract.schemas import CommandAck, Diagnosis, IncidentStep
from trainguard.runtime.state import NodeRecord
from trainguard.services.remediator import conduct, intake
from trainguard.services.remediator.engine import JobView
from trainguard.services.remediator.policy import load_policy

NOW = 1_000_000.0
POLICY = load_policy()
LOST = [f"h{i:02d}" for i in range(8)]


def lost(ident: str = "d1", rev: int = 1, hosts: list[str] = LOST) -> Diagnosis:
    return Diagnosis(id=ident, job="j", anomaly_ids=[f"u-{h}" for h in hosts],
                     cause="hosts_lost", confidence=0.8, hosts=list(hosts),
                     ranks=list(range(4 * len(hosts))), domain="switch sw-1", rev=rev,
                     summary="switch sw-1: 8 hosts, 32 ranks lost within 0.8 s", step=120,
                     time=NOW, onset_at=NOW - 6)


def view(hosts: int = 16, store: str = "h15", nnodes_min: int = 1) -> JobView:
    return JobView(hosts={f"h{i:02d}": NodeRecord(host=f"h{i:02d}", job="j",
                                                  hosts_store=f"h{i:02d}" == store,
                                                  nnodes_min=nnodes_min)
                          for i in range(hosts)}, attempt=0, last_step=120)


def test_one_isolate_step_for_the_domain_then_one_restart() -> None:
    d = lost()
    admitted = intake.admit(d, None, POLICY.cooldown_s, NOW)
    assert admitted.opened and admitted.incident is not None
    intake.plan(admitted, d, POLICY, view(), NOW, failed_in=0, failed_generation=6)
    inc = admitted.incident
    assert inc.domain == "switch sw-1" and inc.hosts == LOST
    assert [s.action for s in inc.actions] == ["isolate", "restart"]
    assert inc.actions[0].params == {"hosts": LOST, "lost": True, "domain": "switch sw-1"}
    act = conduct.act(inc, inc.actions[0])
    assert isinstance(act, conduct.Fence) and act.hosts == LOST and act.send.counts
    assert act.send.attempt == 6  # the generation the loss ended, as its exits count it


def test_a_host_lost_late_joins_the_incident_and_only_it_is_isolated_then() -> None:
    d = lost()
    admitted = intake.admit(d, None, POLICY.cooldown_s, NOW)
    intake.plan(admitted, d, POLICY, view(), NOW, failed_in=0)
    first = admitted.incident
    assert first is not None
    for step in first.actions:
        step.status = "done"
    again = intake.admit(lost(rev=2, hosts=[*LOST, "h08"]), first, POLICY.cooldown_s, NOW + 1)
    assert again.incident is first and not again.opened and again.replan
    assert "h08" in first.hosts
    intake.plan(again, d, POLICY, view(), NOW + 1)
    pending = [(s.action, s.params.get("hosts")) for s in first.actions if s.status == "pending"]
    assert pending == [("isolate", ["h08"])]  # the restart done already is not run again


def test_the_store_host_cannot_go_and_is_escalated_not_isolated() -> None:
    d = lost(hosts=["h14", "h15"])
    admitted = intake.admit(d, None, POLICY.cooldown_s, NOW)
    intake.plan(admitted, d, POLICY, view(), NOW, failed_in=0)
    inc = admitted.incident
    assert inc is not None
    assert [(s.action, s.params.get("hosts")) for s in inc.actions] == [
        ("isolate", ["h14"]), ("escalate", None), ("restart", None)]
    assert "rendezvous store" in inc.summary


def test_too_few_hosts_left_is_escalated_and_restarted_in_place() -> None:
    d = lost()
    admitted = intake.admit(d, None, POLICY.cooldown_s, NOW)
    intake.plan(admitted, d, POLICY, view(nnodes_min=12), NOW, failed_in=0)
    inc = admitted.incident
    assert inc is not None
    assert [s.action for s in inc.actions] == ["escalate"] * 8 + ["restart"]


def test_a_fence_is_done_once_blocklisted_answered_or_not() -> None:
    step = IncidentStep(action="isolate", params={"hosts": ["h00", "h01"]})
    ack = CommandAck(command_id="c", job="j", responder="host-h01", outcome="done")
    conduct.fenced(step, ["h00", "h01"], [ack], "switch sw-1")
    assert step.status == "done"
    assert step.detail == ("blocklisted 2 hosts of switch sw-1: h00, h01; their agents told "
                           "(1 answered)")


def test_observed_the_fence_says_what_it_would_have_done() -> None:
    d = lost(hosts=LOST[:2])
    admitted = intake.admit(d, None, POLICY.cooldown_s, NOW)
    intake.plan(admitted, d, POLICY, view(), NOW, failed_in=0)
    inc = admitted.incident
    assert inc is not None
    step = inc.actions[0]
    recorded = conduct.observe(inc, step, conduct.act(inc, step), frozenset({"isolate"}))
    assert recorded is not None and recorded.status == "observed"
    assert recorded.detail.startswith("would have isolated 2 hosts lost together (h00, h01)")
