"""The policy's [preflight] section: what a node's pre-flight record does."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.contract.schemas import PreflightCheck, PreflightReport
from trainguard.services.remediator import preflight
from trainguard.services.remediator.policy import PolicyError, load_policy


def record(status: str, *checks: PreflightCheck) -> PreflightReport:
    return PreflightReport(id="p1", job="j", host="node-b", status=status,  # type: ignore[arg-type]
                           checks=list(checks))


FAILED = record("fail", PreflightCheck(name="ib:mlx5_1/1", status="fail",
                                       reason="port mlx5_1/1 runs at 100 Gb/sec"),
                PreflightCheck(name="disk", status="ok"))
WARNED = record("warn", PreflightCheck(name="nvml.clocks:gpu0", status="warn",
                                       reason="clocks held down by sw_power_cap"))


def test_the_shipped_policy_blocklists_a_failed_node_with_the_failed_checks() -> None:
    policy = load_policy()
    gate = preflight.decide(FAILED, policy)
    assert gate == preflight.Gate("isolate", "preflight failed on node-b: ib:mlx5_1/1: port "
                                  "mlx5_1/1 runs at 100 Gb/sec")
    entry = preflight.blocklist_entry(FAILED, gate, 100.0, 86400.0)
    assert (entry.cause, entry.job, entry.expires, entry.reason) == \
        ("preflight", "j", 86500.0, gate.reason)
    assert preflight.blocklist_entry(FAILED, gate, 100.0, 0).expires == 0.0
    assert preflight.decide(WARNED, policy) is None
    assert preflight.decide(record("ok"), policy) is None


def test_an_override_file_changes_what_a_preflight_does(tmp_path: Path) -> None:
    f = tmp_path / "policy.toml"
    f.write_text('[preflight]\non_fail = "alert"\non_warn = "alert"\n')
    policy = load_policy(f)
    assert preflight.decide(FAILED, policy) == preflight.Gate(
        "alert", "preflight failed on node-b: ib:mlx5_1/1: port mlx5_1/1 runs at 100 Gb/sec")
    warned = preflight.decide(WARNED, policy)
    assert warned is not None and warned.reason.endswith("clocks held down by sw_power_cap")
    assert policy.causes == load_policy().causes  # the rest of the shipped policy stays
    f.write_text('[preflight]\non_fail = "none"\n')
    assert preflight.decide(FAILED, load_policy(f)) is None


def test_a_bad_preflight_action_names_the_key(tmp_path: Path) -> None:
    f = tmp_path / "policy.toml"
    f.write_text('[preflight]\non_fail = "reboot"\n')
    with pytest.raises(PolicyError, match=r"preflight\.on_fail"):
        load_policy(f)
