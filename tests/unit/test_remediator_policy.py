"""Remediation policy and planning: pure tables, no bus."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from trainguard.contract.schemas import Diagnosis, IncidentStep
from trainguard.runtime.state import NodeRecord
from trainguard.services.remediator.endings import resolved_by_progress
from trainguard.services.remediator.engine import (
    JobView,
    can_isolate,
    find_incident,
    join,
    open_incident,
    plan,
)
from trainguard.services.remediator.policy import PolicyError, load_policy, parse_policy

NOW = 1_000_000.0
POLICY = load_policy()


def diag(cause: str, hosts: list[str], ident: str = "d1", step: int = 120,
         anomalies: list[str] | None = None) -> Diagnosis:
    return Diagnosis(id=ident, job="j", anomaly_ids=anomalies or [f"a-{ident}"],
                     cause=cause, confidence=0.9, ranks=[2], hosts=hosts,  # type: ignore[arg-type]
                     step=step, time=NOW, onset_at=NOW - 5)


TWO_NODES = {"node-a": NodeRecord(job="j", host="node-a", hosts_store=True, nnodes_min=1),
             "node-b": NodeRecord(job="j", host="node-b", hosts_store=False, nnodes_min=1)}

TABLE = [
    ("gpu_lost", ["node-b"], ["save_now", "isolate", "restart"]),
    ("hbm_ecc", ["node-b"], ["isolate", "restart"]),
    ("hbm_ecc", ["node-a"], ["escalate", "restart"]),  # store host: restart in place
    ("network", ["node-a"], ["restart"]),
    ("storage_io", ["node-a"], ["alert"]),
    ("oom", ["node-b"], ["restart"]),
    ("numeric", ["node-a", "node-b"], ["rollback", "restart"]),
    ("sdc_suspect", ["node-b"], ["isolate", "rollback", "restart"]),
    ("straggler", ["node-b"], ["alert"]),
    ("straggler_thermal", ["node-b"], ["alert"]),
    ("data_pipeline", ["node-a"], ["alert"]),
    ("process_crash", ["node-b"], ["restart"]),
    ("rank_hang", ["node-b"], ["dump", "restart"]),
    ("unknown", ["node-b"], ["escalate"]),
]


@pytest.mark.parametrize(("cause", "hosts", "actions"), TABLE,
                         ids=[f"{c}-{'+'.join(h)}" for c, h, _ in TABLE])
def test_plan_per_cause(cause: str, hosts: list[str], actions: list[str]) -> None:
    d = diag(cause, hosts)
    steps, _ = plan(open_incident(d, NOW, NOW), d, POLICY, JobView(hosts=dict(TWO_NODES)), NOW)
    assert [s.action for s in steps] == actions


def test_a_hang_on_many_hosts_dumps_them_in_one_step() -> None:
    """One step for every culprit's host (its commands go out at once); one host keeps its
    own step, as before."""
    d = diag("rank_hang", ["node-a", "node-b", "node-a"])
    steps, _ = plan(open_incident(d, NOW, NOW), d, POLICY, JobView(hosts=dict(TWO_NODES)), NOW)
    assert [(s.action, s.params.get("hosts")) for s in steps] == [
        ("dump", ["node-a", "node-b"]), ("restart", None)]
    one = diag("rank_hang", ["node-b"])
    steps, _ = plan(open_incident(one, NOW, NOW), one, POLICY, JobView(hosts=dict(TWO_NODES)),
                    NOW)
    assert steps[0].params["host"] == "node-b"


def test_rollback_targets_the_failure_step() -> None:
    d = diag("numeric", ["node-a"], step=340)
    steps, _ = plan(open_incident(d, NOW, NOW), d, POLICY, JobView(hosts=dict(TWO_NODES)))
    assert steps[0].params == {"below_step": 340}


def test_hung_jobs_skip_save_now() -> None:
    policy = parse_policy('[causes.rank_hang]\nactions = ["save_now", "restart"]\n')
    d = diag("rank_hang", ["node-b"])
    steps, notes = plan(open_incident(d, NOW, NOW), d, policy, JobView(hosts=dict(TWO_NODES)))
    assert [s.action for s in steps] == ["restart"] and "hung" in notes[0]


BUDGET = POLICY.restart_budget_per_hour
SPENT = [
    # cause, failed attempt, restarts in the hour, attempts among them, repeats: plan
    ("process_crash", None, BUDGET, set(), 1, ["escalate", "hold"]),  # one more would pass
    ("process_crash", 3, BUDGET, {3}, 1, ["restart"]),  # its own (torchrun's) is counted
    ("process_crash", 3, BUDGET + 1, {3}, 1, ["escalate", "hold"]),
    ("rank_hang", 3, BUDGET - 1, set(), 1, ["dump", "restart"]),  # the last one allowed
    ("rank_hang", 3, BUDGET, set(), 1, ["escalate", "hold"]),
    ("straggler", 3, BUDGET * 2, set(), 1, ["alert"]),  # restarts nothing: no budget
    ("oom", 0, 0, set(), 2, ["escalate", "hold"]),  # escalate_after = 2
    ("oom", 0, 0, set(), 1, ["restart"]),
]


@pytest.mark.parametrize(("cause", "failed_in", "restarts", "attempts", "repeats", "actions"),
                         SPENT)
def test_a_spent_budget_or_a_repeating_cause_holds_the_job(
        cause: str, failed_in: int | None, restarts: int, attempts: set[int], repeats: int,
        actions: list[str]) -> None:
    d = diag(cause, ["node-b"])
    inc = open_incident(d, NOW, NOW)
    inc.failure_generation, inc.signature = failed_in, "process_crash: rank 2 on node-b: boom"
    view = JobView(hosts=dict(TWO_NODES), restarts_last_hour=restarts,
                   ended_attempts=frozenset(attempts), cause_count_last_hour=repeats)
    steps, _ = plan(inc, d, POLICY, view, NOW)
    assert [s.action for s in steps] == actions
    if "hold" in actions:  # on-call is told why, and what failed
        reason = str(steps[0].params["reason"])
        assert ("budget" in reason) is (repeats == 1) and "rank 2 on node-b: boom" in reason
        assert steps[1].params["reason"] in reason


def test_sustained_stragglers_are_isolated_when_policy_allows() -> None:
    d = diag("straggler_thermal", ["node-b"])
    view = JobView(hosts=dict(TWO_NODES), first_seen_at=NOW - 400)
    steps, notes = plan(open_incident(d, NOW, NOW), d, POLICY, view, NOW)
    assert [s.action for s in steps] == ["alert", "isolate", "restart"] and notes
    plain = diag("straggler", ["node-b"])
    steps, _ = plan(open_incident(plain, NOW, NOW), plain, POLICY, view, NOW)
    assert [s.action for s in steps] == ["alert"]


def test_a_host_that_cannot_leave_restarts_only_the_rank_its_fault_names() -> None:
    """The store host's GPU fault: its one rank gets a new process (in place where the job
    can take it); the others keep theirs. Where the fault names several ranks, or the host
    can leave, the restart stays the group's."""
    view = JobView(hosts=dict(TWO_NODES))
    d = diag("hbm_ecc", ["node-a"])
    steps, notes = plan(open_incident(d, NOW, NOW), d, POLICY, view, NOW)
    assert [s.action for s in steps] == ["escalate", "restart"]
    assert steps[1].params == {"rank": 2, "host": "node-a", "fallback": "group"}
    assert "restarting in place" in notes[0]
    two = msgspec.structs.replace(d, ranks=[0, 1])
    steps, _ = plan(open_incident(two, NOW, NOW), two, POLICY, view, NOW)
    assert [(s.action, s.params) for s in steps][-1] == ("restart", {})
    ended = msgspec.structs.replace(d, worker_exited=True)  # its agent replaces it already
    steps, _ = plan(open_incident(ended, NOW, NOW), ended, POLICY, view, NOW)
    assert [(s.action, s.params) for s in steps][-1] == ("restart", {})
    leaves = diag("hbm_ecc", ["node-b"])
    steps, _ = plan(open_incident(leaves, NOW, NOW), leaves, POLICY, view, NOW)
    assert [(s.action, s.params) for s in steps] == [("isolate", {"host": "node-b"}),
                                                     ("restart", {})]


def test_isolation_never_breaks_the_elastic_minimum() -> None:
    assert can_isolate("node-b", JobView(hosts=dict(TWO_NODES))) == (True, "")
    ok, why = can_isolate("node-a", JobView(hosts=dict(TWO_NODES)))
    assert not ok and "rendezvous store" in why
    strict = {h: msgspec.structs.replace(v, nnodes_min=2) for h, v in TWO_NODES.items()}
    ok, why = can_isolate("node-b", JobView(hosts=strict))
    assert not ok and "minimum 2" in why
    ok, why = can_isolate("node-c", JobView(hosts=dict(TWO_NODES)))
    assert not ok


def test_diagnoses_join_the_open_incident_of_their_root() -> None:
    first = diag("network", ["node-a"], "d1", anomalies=["hang-1"])
    inc = open_incident(first, NOW, NOW)
    root = diag("gpu_lost", ["node-b"], "d2", anomalies=["xid-1", "hang-1"])
    assert find_incident([inc], root, 60, NOW) is inc
    assert join(inc, root) is True and inc.cause == "gpu_lost" and inc.hosts == ["node-b"]
    same = diag("gpu_lost", ["node-b"], "d3", anomalies=["crash-9"])
    assert find_incident([inc], same, 60, NOW + 10) is inc
    assert find_incident([inc], same, 60, NOW + 600) is None  # past the cooldown
    other = diag("oom", ["node-a"], "d4")
    assert find_incident([inc], other, 60, NOW) is None


LOOPS = [
    # incident: cause, status, failure step, last step at; diagnosis: cause, step, time: joins
    ("process_crash", "mitigating", 3, None, "process_crash", 2, NOW + 600, True),  # a loop
    ("process_crash", "mitigating", 3, None, "process_crash", None, NOW + 600, True),
    ("process_crash", "mitigating", None, None, "process_crash", None, NOW + 600, True),
    ("process_crash", "mitigating", 3, None, "process_crash", 40, NOW + 600, False),  # got on
    ("process_crash", "mitigating", 3, None, "process_crash", 40, NOW + 30, True),  # cooldown
    ("process_crash", "mitigating", 3, None, "oom", 2, NOW + 600, False),
    ("rank_hang", "mitigating", 3, None, "rank_hang", 2, NOW + 600, False),  # no launcher loop
    ("process_crash", "failed", 3, NOW + 550, "process_crash", 2, NOW + 600, True),  # late
    ("process_crash", "failed", 3, NOW + 500, "process_crash", 2, NOW + 600, False),
    ("process_crash", "resolved", 3, NOW + 590, "process_crash", 2, NOW + 600, False),
    ("process_crash", "escalated", 3, NOW + 590, "process_crash", 2, NOW + 600, False),
]


@pytest.mark.parametrize(("cause", "status", "failure_step", "last_at", "d_cause", "d_step",
                          "now", "joins"), LOOPS)
def test_a_crash_loop_is_one_incident(cause: str, status: str, failure_step: int | None,
                                      last_at: float | None, d_cause: str, d_step: int | None,
                                      now: float, joins: bool) -> None:
    inc = open_incident(diag(cause, ["node-b"], "d1", step=0), NOW, NOW)
    inc.status, inc.failure_step = status, failure_step  # type: ignore[assignment]
    if last_at is not None:
        inc.actions = [IncidentStep(action="hold", status="done", at=last_at)]
    again = Diagnosis(id="d2", job="j", anomaly_ids=["a-d2"], cause=d_cause,  # type: ignore[arg-type]
                      confidence=0.9, ranks=[2], hosts=["node-b"], step=d_step, time=now)
    assert (find_incident([inc], again, 60, now) is inc) is joins


def test_resolution_needs_a_new_attempt_past_the_failure_step() -> None:
    inc = open_incident(diag("process_crash", ["node-b"], step=100), NOW, NOW)
    assert not resolved_by_progress(inc, JobView(attempt=1, last_step=150), 1)
    assert not resolved_by_progress(inc, JobView(attempt=2, last_step=90), 1)
    assert resolved_by_progress(inc, JobView(attempt=2, last_step=101), 1)
    inc.failure_step = None  # it failed before its first step: any step is past it
    assert resolved_by_progress(inc, JobView(attempt=2, last_step=0), 1)
    assert not resolved_by_progress(inc, JobView(attempt=2), 1)


def test_bad_policy_files_are_refused_with_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "policy.toml"
    bad.write_text('[defaults]\ncooldown_s = 30\n\n[causes.oom]\nactions = ["reboot"]\n')
    with pytest.raises(PolicyError, match=r"policy.toml, line 5: causes.oom.actions: unknown "
                                         r"action 'reboot'"):
        load_policy(bad)
    bad.write_text('[causes.oom]\nactions = ["restart"]\ncoolness = 1\n')
    with pytest.raises(PolicyError, match=r"line 3: causes.oom.coolness: unknown key 'coolness'"):
        load_policy(bad)
    bad.write_text("[defaults\n")
    with pytest.raises(PolicyError, match=r"policy\.toml"):
        load_policy(bad)
    with pytest.raises(PolicyError, match="cannot read policy file"):
        load_policy(tmp_path / "missing.toml")


def test_override_file_replaces_only_what_it_names(tmp_path: Path) -> None:
    f = tmp_path / "p.toml"
    f.write_text('[defaults]\nrestart_budget_per_hour = 2\n\n[causes.oom]\nactions = ["alert"]\n')
    p = load_policy(f)
    assert p.restart_budget_per_hour == 2 and p.cooldown_s == POLICY.cooldown_s
    assert p.for_cause("oom").actions == ("alert",)
    assert p.for_cause("gpu_lost").actions == POLICY.for_cause("gpu_lost").actions


@pytest.mark.parametrize("status", ["mitigating", "resolved", "escalated"])
def test_a_consequence_joins_its_failures_incident_even_once_it_is_over(status: str) -> None:
    """A throughput drop the diagnoser joined to a straggler's diagnosis (``collateral``)
    goes to the straggler's incident, open or not: never an incident (a page) of its own.
    The same revision without the collateral mark is a new failure once the incident is
    over."""
    d = diag("straggler", ["node-a"], "d1", anomalies=["straggler-1"])
    inc = open_incident(d, NOW, NOW)
    inc.status = status  # type: ignore[assignment]
    later = msgspec.structs.replace(d, anomaly_ids=["straggler-1", "drop-1"],
                                    collateral=["drop-1"], rev=2)
    assert find_incident([inc], later, 60, NOW + 600) is inc
    again = msgspec.structs.replace(d, anomaly_ids=["straggler-1", "straggler-2"], rev=2)
    assert (find_incident([inc], again, 60, NOW + 600) is inc) is (status == "mitigating")


@pytest.mark.parametrize("status", ["mitigating", "resolved", "escalated"])
def test_more_evidence_on_a_handled_failure_joins_its_incident_even_once_it_is_over(
        status: str) -> None:
    """A hang's flight-recorder verdict (a revision on the same anomaly) delivered again
    after the in-place recovery it named was done: opened as a new incident, it would kill
    the rank's replacement. A revision with a new anomaly is a new failure."""
    d = diag("rank_hang", ["node-a"], "d1", anomalies=["hang-1"])
    inc = open_incident(d, NOW, NOW)
    inc.status = status  # type: ignore[assignment]
    verdict = msgspec.structs.replace(d, summary="flight recorder: stopped short", rev=2)
    assert find_incident([inc], verdict, 60, NOW + 600) is inc
    again = msgspec.structs.replace(d, anomaly_ids=["hang-2"], rev=3)
    assert (find_incident([inc], again, 60, NOW + 600) is inc) is (status == "mitigating")
