"""Observe-only mode: which action kinds are observed (policy default, job override, per
kind), what an observed step records instead of doing, how an observed incident ends, and
how the bridge and the CLI say it. Pure tables; the running remediator is
tests/integration/test_remediator_observe.py."""

from __future__ import annotations

from typing import Any

import pytest

from trainguard.cli.observe import describe, parse_actions
from trainguard.contract.errors import ConfigError
from trainguard.contract.schemas import OBSERVABLE_ACTIONS, Incident, IncidentStep, JobMode
from trainguard.runtime.state import NodeRecord, encode_job_mode, read_job_mode
from trainguard.services.bridge.rules import actions_text, notice
from trainguard.services.remediator import conduct, endings
from trainguard.services.remediator.engine import (
    JobView,
    Outcome,
    action_event,
    conclude,
    finish_step,
    merge_plan,
    observing,
)
from trainguard.services.remediator.policy import PolicyError, load_policy, parse_policy

NOW = 1_000_000.0
ACT = load_policy()
OBSERVE = parse_policy('[observe]\nmode = "observe"\n')
EVERY = OBSERVABLE_ACTIONS


def step(action: str, status: str = "pending", **params: Any) -> IncidentStep:
    return IncidentStep(action=action, status=status, params=params)  # type: ignore[arg-type]


def incident(*steps: IncidentStep, **kw: Any) -> Incident:
    fields: dict[str, Any] = {"id": "i1", "job": "j", "cause": "network",
                              "status": "mitigating", "detected_at": NOW - 9,
                              "failure_step": 17, "hosts": ["node-b"],
                              "summary": "network on node-b", **kw}
    return Incident(actions=list(steps), **fields)


# -- which kinds are observed -------------------------------------------------------------

@pytest.mark.parametrize(("policy", "job", "observed"), [
    (ACT, None, frozenset()),                                   # shipped: act
    (OBSERVE, None, EVERY),                                     # policy default: observe
    (OBSERVE, JobMode(mode="act"), frozenset()),                # the job's own mode wins
    (ACT, JobMode(mode="observe"), EVERY),
    (ACT, JobMode(mode="observe", actions=["isolate", "restart"]),
     frozenset({"isolate", "restart"})),                        # per kind: the rest act
    (parse_policy('[observe]\nmode = "observe"\nactions = ["hold"]\n'), None,
     frozenset({"hold"})),
    (parse_policy('[observe]\nactions = ["hold"]\n'), None, frozenset()),  # kinds, but act
])
def test_what_is_observed(policy: Any, job: JobMode | None, observed: frozenset[str]) -> None:
    assert observing(policy, job) == observed


def test_an_override_file_keeps_the_shipped_observe_keys_it_does_not_name(tmp_path: Any) -> None:
    f = tmp_path / "p.toml"
    f.write_text('[observe]\nmode = "observe"\n')
    assert load_policy(f).observe == JobMode(mode="observe")
    f.write_text('[defaults]\ncooldown_s = 5\n')
    assert load_policy(f).observe == JobMode(mode="act")


@pytest.mark.parametrize(("text", "message"), [
    ('[observe]\nmode = "watch"\n', "line 2: observe.mode: unknown mode 'watch'; known: act, "
                                    "observe"),
    ('[observe]\nmode = "observe"\nactions = ["alert"]\n',
     "line 3: observe.actions: 'alert' cannot be observed; observable: dump, hold"),
    ('[observe]\nmodes = "observe"\n', "modes"),
])
def test_a_bad_observe_section_names_its_key(text: str, message: str) -> None:
    with pytest.raises(PolicyError) as err:
        parse_policy(text)
    assert message in str(err.value)


def test_a_stored_mode_that_cannot_be_read_observes_everything() -> None:
    assert read_job_mode(encode_job_mode(JobMode(mode="act"))) == JobMode(mode="act")
    garbled = read_job_mode(b"observe please")
    assert garbled.observed() == EVERY and "unreadable" in garbled.by


# -- what an observed step records ----------------------------------------------------------

SEND_ALL = conduct.Send("restart", ["node-a", "node-b"], counts=True, attempt=3)
SEND_ONE = conduct.Send("restart", ["node-b"], {"rank": 3, "fallback": "group"}, host="node-b")


@pytest.mark.parametrize(("action", "act", "detail"), [
    ("restart", SEND_ALL, "would have sent restart to every host (node-a, node-b)"),
    ("restart", SEND_ONE, "would have sent restart to node-b (fallback=group rank=3)"),
    ("isolate", conduct.Isolate(conduct.Send("isolate", ["node-b"], host="node-b")),
     "would have isolated node-b (blocklisted it, run the isolate hook and told its agent)"),
    ("dump", conduct.Send("dump", ["node-b"], {"ranks": [3]}, host="node-b"),
     "would have sent dump to node-b (ranks=[3])"),
    ("dump", conduct.SendEach([conduct.Send("dump", [h], {"ranks": [1, 3]}, host=h)
                               for h in ("node-a", "node-b")]),
     "would have sent dump to each of 2 hosts at once (node-a, node-b) (ranks=[1, 3])"),
    ("save_now", conduct.Save(60.0), "would have saved a checkpoint now (deadline 60s)"),
    ("rollback", conduct.Rollback(17), "would have rolled the job back below step 17"),
    ("hold", conduct.Send("hold", ["node-a"]), "would have sent hold to every host (node-a)"),
])
def test_an_observed_effect_is_recorded_not_done(action: str, act: conduct.Act,
                                                 detail: str) -> None:
    inc = incident(step(action), restarted_attempt=3)
    assert conduct.observe(inc, inc.actions[0], act, EVERY) == Outcome("observed", detail)
    assert inc.restarted_attempt == (None if action == "restart" else 3)  # nothing restarted


@pytest.mark.parametrize("act", [
    Outcome("done", "alert: x"),           # alert and escalate change nothing: they run
    conduct.Restart(), conduct.Hold(),     # a look at the job first, as when acting
])
def test_what_has_no_effect_of_its_own_runs_even_when_observed(act: conduct.Act) -> None:
    inc = incident(step("restart"))
    assert conduct.observe(inc, inc.actions[0], act, EVERY) is None


def test_a_kind_not_observed_is_carried_out() -> None:
    inc = incident(step("restart"))
    assert conduct.observe(inc, inc.actions[0], SEND_ALL, frozenset({"isolate"})) is None
    assert conduct.observe(inc, inc.actions[0], SEND_ALL, frozenset()) is None


def test_an_observed_step_is_announced_as_observed_and_changes_nothing_else() -> None:
    restart = step("restart", "observed")
    restart.detail = "would have sent restart to every host (node-b)"
    inc = incident(restart)
    finish_step(inc, restart)
    assert inc.status == "mitigating" and not inc.escalation
    assert action_event(inc, restart, NOW).status == "observed"
    assert conclude(inc, NOW) and inc.status == "mitigating"  # waits for the job itself


def test_an_observed_hold_escalates_but_does_not_fail() -> None:
    inc = incident(step("escalate", "done"), step("hold", "observed"),
                   escalation="holding the job: budget spent")
    finish_step(inc, inc.actions[1])
    assert inc.status == "mitigating"
    conclude(inc, NOW)
    assert inc.status == "escalated"  # a human was told; the job still runs


def test_a_re_plan_keeps_the_observed_record_and_decides_again() -> None:
    old = [step("restart", "observed"), step("dump", "done", host="node-b")]
    new = [step("dump", host="node-b"), step("restart")]
    merged = merge_plan(old, new)
    assert [(s.action, s.status) for s in merged] == [
        ("restart", "observed"), ("dump", "done"), ("restart", "pending")]


# -- how an observed incident ends ----------------------------------------------------------

@pytest.mark.parametrize(("view", "resolved", "why"), [
    (JobView(last_step=18, attempt=1), set(), "progress"),   # recovered by itself
    (JobView(last_step=17, attempt=0), set(), None),         # still stuck: stays open
    (JobView(last_step=17), {"a1"}, "anomalies"),            # the detector cleared it
])
def test_an_observed_incident_ends_when_the_job_recovers_by_itself(
        view: JobView, resolved: set[str], why: str | None) -> None:
    inc = incident(step("restart", "observed"), anomaly_ids=["a1"], mitigated_at=NOW - 1)
    assert endings.resolution(inc, view, resolved, ACT, NOW) == why


def test_an_observed_incident_nobody_recovered_escalates_at_the_timeout() -> None:
    inc = incident(step("restart", "observed"), anomaly_ids=["a1"], detected_at=NOW - 601)
    assert endings.resolution(inc, JobView(last_step=17), set(), ACT, NOW) == "timeout"


def test_an_observed_restart_does_not_loop_a_non_crashing_job_into_a_hold() -> None:
    inc = incident(step("restart", "observed"))
    assert endings.hold_reason(inc, JobView(restarts_last_hour=99), ACT) is None
    acted = incident(step("restart", "done"))
    hosts = {"h": NodeRecord(job="j", host="h")}
    assert endings.hold_reason(acted, JobView(restarts_last_hour=99, hosts=hosts),
                               ACT) is not None


# -- how it is said -------------------------------------------------------------------------

def test_the_page_says_would_have_and_observe_only() -> None:
    restart = step("restart", "observed")
    restart.detail = "would have sent restart to every host (node-b)"
    inc = incident(step("alert", "done"), restart)
    text = actions_text(inc)
    assert "restart: would have sent restart to every host (node-b) (observe-only)" in text
    assert "alert: done" in text
    n = notice(inc)
    assert "[OBSERVE-ONLY]" in n.title and "carried out none" in n.summary
    assert "OBSERVE" not in notice(incident(step("restart", "done"))).title


def test_the_cli_names_the_flag_and_the_fix() -> None:
    assert parse_actions("restart, isolate,restart") == ["restart", "isolate"]
    assert parse_actions("") == []
    with pytest.raises(ConfigError, match=r"--actions: cannot observe alert; use a "
                                          r"comma-separated list of dump, hold"):
        parse_actions("restart,alert")


def test_show_says_which_mode_is_in_force() -> None:
    assert "policy" in describe("j", None)
    assert describe("j", JobMode(mode="act", by="ann")) == (
        "j: act: decisions are carried out [set by ann]")
    assert describe("j", JobMode(mode="observe", actions=["restart"])) == (
        "j: observe: restart recorded, not carried out")
    assert "(every action)" in describe("j", JobMode(mode="observe"))
