"""The policy's [preflight] section: what a node's pre-flight record does."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.contract.schemas import PreflightCheck, PreflightReport
from trainguard.services.remediator import preflight
from trainguard.services.remediator.policy import PolicyError, load_policy

NOW = 1_000_000.0


def record(status: str, *checks: PreflightCheck, trigger: str = "launch",
           age: float = 1.0) -> PreflightReport:
    return PreflightReport(id="p1", job="j", host="node-b", status=status,  # type: ignore[arg-type]
                           checks=list(checks), trigger=trigger,  # type: ignore[arg-type]
                           time=NOW - age)


FAILED = record("fail", PreflightCheck(name="ib:mlx5_1/1", status="fail",
                                       reason="port mlx5_1/1 runs at 100 Gb/sec"),
                PreflightCheck(name="disk", status="ok"))
WARNED = record("warn", PreflightCheck(name="nvml.clocks:gpu0", status="warn",
                                       reason="clocks held down by sw_power_cap"))


def test_the_shipped_policy_blocklists_a_failed_node_with_the_failed_checks() -> None:
    policy = load_policy()
    gate = preflight.decide(FAILED, policy, NOW)
    assert gate == preflight.Gate("isolate", "preflight failed on node-b: ib:mlx5_1/1: port "
                                  "mlx5_1/1 runs at 100 Gb/sec")
    entry = preflight.blocklist_entry(FAILED, gate, 100.0, 86400.0)
    assert (entry.cause, entry.job, entry.expires, entry.reason) == \
        ("preflight", "j", 86500.0, gate.reason)
    assert preflight.blocklist_entry(FAILED, gate, 100.0, 0).expires == 0.0
    assert preflight.decide(WARNED, policy, NOW) is None
    assert preflight.decide(record("ok"), policy, NOW) is None


def test_only_a_fresh_record_from_before_the_ranks_start_keeps_a_node_out() -> None:
    """A check re-run on a training node, or a record redelivered long after (past an
    ``unblock``), is announced, never a blocklist entry."""
    policy = load_policy()
    failing = FAILED.checks
    for late in (record("fail", *failing, trigger="command"),
                 record("fail", *failing, trigger="cli"),
                 record("fail", *failing, age=preflight.MAX_AGE_S + 1)):
        gate = preflight.decide(late, policy, NOW)
        assert gate is not None and gate.action == "alert"


def test_an_override_file_changes_what_a_preflight_does(tmp_path: Path) -> None:
    f = tmp_path / "policy.toml"
    f.write_text('[preflight]\non_fail = "alert"\non_warn = "alert"\n')
    policy = load_policy(f)
    assert preflight.decide(FAILED, policy, NOW) == preflight.Gate(
        "alert", "preflight failed on node-b: ib:mlx5_1/1: port mlx5_1/1 runs at 100 Gb/sec")
    warned = preflight.decide(WARNED, policy, NOW)
    assert warned is not None and warned.reason.endswith("clocks held down by sw_power_cap")
    assert policy.causes == load_policy().causes  # the rest of the shipped policy stays
    f.write_text('[preflight]\non_fail = "none"\n')
    assert preflight.decide(FAILED, load_policy(f), NOW) is None


def test_a_bad_preflight_action_names_the_key(tmp_path: Path) -> None:
    f = tmp_path / "policy.toml"
    f.write_text('[preflight]\non_fail = "reboot"\n')
    with pytest.raises(PolicyError, match=r"preflight\.on_fail"):
        load_policy(f)
