"""Remediation policy and planning: pure tables, no bus."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from trainguard.schemas import Diagnosis
from trainguard.services.remediator.engine import (
    JobView,
    can_isolate,
    find_incident,
    join,
    open_incident,
    plan,
    resolved_by_progress,
)
from trainguard.services.remediator.policy import PolicyError, load_policy, parse_policy
from trainguard.state import NodeRecord

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


def test_rollback_targets_the_failure_step() -> None:
    d = diag("numeric", ["node-a"], step=340)
    steps, _ = plan(open_incident(d, NOW, NOW), d, POLICY, JobView(hosts=dict(TWO_NODES)))
    assert steps[0].params == {"below_step": 340}


def test_hung_jobs_skip_save_now() -> None:
    policy = parse_policy('[causes.rank_hang]\nactions = ["save_now", "restart"]\n')
    d = diag("rank_hang", ["node-b"])
    steps, notes = plan(open_incident(d, NOW, NOW), d, policy, JobView(hosts=dict(TWO_NODES)))
    assert [s.action for s in steps] == ["restart"] and "hung" in notes[0]


def test_budget_spent_escalates_instead_of_restarting() -> None:
    d = diag("process_crash", ["node-b"])
    view = JobView(hosts=dict(TWO_NODES), restarts_last_hour=POLICY.restart_budget_per_hour)
    steps, _ = plan(open_incident(d, NOW, NOW), d, POLICY, view)
    assert [s.action for s in steps] == ["escalate"]
    assert "budget" in steps[0].params["reason"]


def test_a_repeating_cause_escalates() -> None:
    d = diag("oom", ["node-b"])
    steps, _ = plan(open_incident(d, NOW, NOW), d, POLICY,
                    JobView(hosts=dict(TWO_NODES), cause_count_last_hour=2))
    assert [s.action for s in steps] == ["escalate"]


def test_sustained_stragglers_are_isolated_when_policy_allows() -> None:
    d = diag("straggler_thermal", ["node-b"])
    view = JobView(hosts=dict(TWO_NODES), first_seen_at=NOW - 400)
    steps, notes = plan(open_incident(d, NOW, NOW), d, POLICY, view, NOW)
    assert [s.action for s in steps] == ["alert", "isolate", "restart"] and notes
    plain = diag("straggler", ["node-b"])
    steps, _ = plan(open_incident(plain, NOW, NOW), plain, POLICY, view, NOW)
    assert [s.action for s in steps] == ["alert"]


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


def test_resolution_needs_a_new_attempt_past_the_failure_step() -> None:
    inc = open_incident(diag("process_crash", ["node-b"], step=100), NOW, NOW)
    assert not resolved_by_progress(inc, JobView(attempt=1, last_step=150), 1)
    assert not resolved_by_progress(inc, JobView(attempt=2, last_step=90), 1)
    assert resolved_by_progress(inc, JobView(attempt=2, last_step=101), 1)


def test_bad_policy_files_are_refused_with_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "policy.toml"
    bad.write_text('[defaults]\ncooldown_s = 30\n\n[causes.oom]\nactions = ["reboot"]\n')
    with pytest.raises(PolicyError, match=r"policy.toml, line 5: unknown action 'reboot'"):
        load_policy(bad)
    bad.write_text('[causes.oom]\nactions = ["restart"]\ncoolness = 1\n')
    with pytest.raises(PolicyError, match=r"line 3: unknown key 'coolness'"):
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
