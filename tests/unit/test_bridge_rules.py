"""The bridge's pure parts: what each sink hears of an incident revision, the wire
formats, and routes, grouping and rate limits from the policy file."""

from __future__ import annotations

import json
from typing import Any

import pytest

from trainguard.contract.codec import decode_durable
from trainguard.contract.schemas import Incident, IncidentStep
from trainguard.services.bridge import payloads
from trainguard.services.bridge.routes import (
    NotifyPolicyError,
    RateLimiter,
    group_of,
    parse_notify,
    sinks_for,
)
from trainguard.services.bridge.rules import Sent, labels_of, notice, severity_of, wants
from trainguard.services.remediator.policy import parse_policy

ALL = frozenset({"alertmanager", "webhook", "slack"})


def inc(status: str = "open", rev: int = 1, **kw: Any) -> Incident:
    base: dict[str, Any] = {"id": "i1", "job": "llama", "cause": "rank_hang", "ranks": [3],
                            "hosts": ["node-b"], "onset_at": 100.0, "detected_at": 105.5,
                            "summary": "rank 3 stuck in data"}
    return Incident(status=status, rev=rev, **{**base, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize(("sent", "incident", "sink", "expected"), [
    (None, inc(), "webhook", True),                                  # a new incident pages
    (Sent(job="llama", incident="i1", revs={"webhook": 1}, states={"webhook": "firing"}),
     inc(), "webhook", False),                                       # the same revision again
    (Sent(job="llama", incident="i1", revs={"webhook": 1}, states={"webhook": "firing"}),
     inc("mitigating", 2), "webhook", False),                        # same state: quiet
    (Sent(job="llama", incident="i1", revs={"alertmanager": 1}),
     inc("mitigating", 2), "alertmanager", True),                    # AM follows every rev
    (Sent(job="llama", incident="i1", revs={"alertmanager": 3}),
     inc("mitigating", 2), "alertmanager", False),                   # an older rev, late
    (Sent(job="llama", incident="i1", revs={"webhook": 2}, states={"webhook": "firing"}),
     inc("resolved", 3), "webhook", True),                           # the all-clear
    (Sent(job="llama", incident="i1", revs={"slack": 2}, states={"slack": "firing"}),
     inc("escalated", 3), "slack", True),                            # a human is needed
    (None, inc("resolved", 4), "slack", False),                      # never told it opened
    (Sent(job="llama", incident="i1", revs={"slack": 1}, states={"slack": "firing"},
          suppressed=["slack"]), inc("resolved", 2), "slack", False),  # page was held back
])
def test_what_each_sink_hears(sent: Sent | None, incident: Incident, sink: str,
                              expected: bool) -> None:
    assert wants(sent, sink, incident) is expected


@pytest.mark.parametrize(("incident", "severity"), [
    (inc(), "warning"),
    (inc("escalated"), "critical"),
    (inc("failed"), "critical"),
    (inc(cause="unknown"), "critical"),
    (inc(actions=[IncidentStep(action="escalate")]), "critical"),
    (inc("resolved"), "info"),
])
def test_severity(incident: Incident, severity: str) -> None:
    assert severity_of(incident) == severity


def test_alertmanager_alert_carries_labels_and_what_on_call_reads() -> None:
    i = inc("mitigating", 2, mitigated_at=112.0, steps_lost=40, actions=[
        IncidentStep(action="dump", status="done"),
        IncidentStep(action="restart", status="sent", detail="attempt 1")])
    n = notice(i, "http://dash:9466/")
    alert = payloads.alert(n, labels_of(i, n.severity))
    assert alert["labels"] == {"alertname": "TrainguardIncident", "job": "llama",
                               "cause": "rank_hang", "severity": "warning", "host": "node-b",
                               "incident": "i1"}
    notes = alert["annotations"]
    assert isinstance(notes, dict)
    assert notes["summary"] == "rank 3 stuck in data"
    assert notes["culprit"] == "rank 3 on node-b"
    assert notes["actions"] == "dump: done; restart: sent (attempt 1)"
    assert notes["time_to_detect"] == "5.5s" and notes["time_to_mitigate"] == "6.5s"
    assert notes["steps_lost"] == "40"
    assert notes["dashboard"] == alert["generatorURL"] == "http://dash:9466/?job=llama&incident=i1"
    assert alert["startsAt"] == "1970-01-01T00:01:45.500Z" and "endsAt" not in alert
    resolved = payloads.alert(n, labels_of(i, "warning"), ends_at=200.0)
    assert resolved["endsAt"] == "1970-01-01T00:03:20.000Z"


def test_cloudevent_is_binary_mode_with_the_incident_as_body() -> None:
    i = inc("resolved", 5, resolved_at=300.0)
    req = payloads.cloudevent(notice(i))
    h = req.headers
    assert h["ce-specversion"] == "1.0" and h["ce-id"] == "i1.5"
    assert h["ce-type"] == "io.trainguard.incident.v1" and h["ce-source"] == "trainguard/bridge"
    assert h["ce-subject"] == "llama/i1" and h["ce-time"] == "1970-01-01T00:05:00.000Z"
    assert h["ce-tgstate"] == "resolved" and h["Content-Type"] == "application/json"
    assert "ce-tgdashboard" not in h  # no dashboard configured
    assert decode_durable(req.body, Incident) == i


def test_slack_message() -> None:
    i = inc("escalated", 3, escalation="restart budget spent", steps_lost=7,
            signature="process_crash rank 3 node-b: RuntimeError: boom")
    body = json.loads(payloads.slack(notice(i, "http://d/")).body)
    assert body["text"] == "[ESCALATED] llama: rank_hang (rank 3 on node-b)"
    text = body["blocks"][0]["text"]["text"]
    assert "escalated: restart budget spent" in text and "RuntimeError: boom" in text
    assert "detected in 5.5s" in text and "7 steps lost" in text
    assert "<http://d/?job=llama&incident=i1|Open the dashboard>" in text


POLICY = """
[defaults]
cooldown_s = 60   # notify is read by the bridge, defaults by the remediator

[notify]
sinks = ["alertmanager", "webhook"]
group_by = ["job"]
rate_limit = 2
rate_window_s = 60

[[notify.routes]]
causes = ["straggler"]
sinks = ["slack"]

[[notify.routes]]
jobs = ["quiet"]
sinks = []
"""


def test_routes_first_match_wins_and_only_configured_sinks() -> None:
    p = parse_notify(POLICY)
    assert sinks_for(p, "llama", "straggler", "warning", ALL) == ["slack"]
    assert sinks_for(p, "quiet", "oom", "warning", ALL) == []
    assert sinks_for(p, "llama", "oom", "warning", ALL) == ["alertmanager", "webhook"]
    assert sinks_for(p, "llama", "oom", "warning", frozenset({"webhook"})) == ["webhook"]
    assert group_of(p, {"job": "llama", "cause": "oom"}) == "job=llama"


def test_the_remediator_reads_the_same_file() -> None:
    """One policy file: the remediator takes [defaults] and [causes.*], leaves [notify]."""
    assert parse_policy(POLICY).cooldown_s == 60


def test_rate_limit_per_group_and_window() -> None:
    limiter = RateLimiter(2, 60.0)
    assert limiter.allow("a", 0.0) and limiter.allow("a", 1.0)
    assert not limiter.allow("a", 2.0)
    assert limiter.allow("b", 2.0)           # another group has its own budget
    assert limiter.allow("a", 61.0)          # the first send left the window
    assert RateLimiter(0, 60.0).allow("a", 0.0)  # 0: no limit


@pytest.mark.parametrize(("text", "message"), [
    ("[notify]\nrate_limit = \"two\"\n", "line 2: [notify]: Expected `int`, got `str`"),
    ("# sinks = 1\n[notify]\nsinks = [\"pager\"]\n",
     "line 3: [notify]: Invalid enum value 'pager'"),
    ("[notify]\nrepeat = 5\n", "line 2: [notify]: Object contains unknown field `repeat`"),
    ("[notify]\n\n[[notify.routes]]\ncauses = [\"flu\"]\nsinks = []\n",
     "line 4: [notify]: Invalid enum value 'flu'"),
    ("[notify]\nrate_window_s = -1\n", "line 2: [notify]: rate_window_s must not be negative"),
    # The second route's sinks, not the section's (nor the first route's) on an earlier line.
    ("[notify]\nsinks = []\n[[notify.routes]]\nsinks = []\n[[notify.routes]]\n"
     "sinks = [1]\n", "line 6: [notify]: Expected `str`, got `int` - at `$.routes[1].sinks[0]`"),
    ("[defaults]\nrate_limit = 1\n[notify]\nrate_limit = -3\n",
     "line 4: [notify]: rate_limit must not be negative"),
    ("[notify]\nrepeat_s = 0\n", "line 2: [notify]: repeat_s must be positive"),
])
def test_a_bad_notify_section_names_its_line(text: str, message: str) -> None:
    with pytest.raises(NotifyPolicyError) as err:
        parse_notify(text, "p.toml")
    assert f"p.toml, {message}" in str(err.value)


def test_sink_urls_are_checked_and_a_bridge_without_sinks_is_skipped() -> None:
    from trainguard.contract.errors import ConfigError
    from trainguard.runtime.config import load_settings
    from trainguard.services.bridge.service import BridgeService
    from trainguard.services.bridge.settings import BridgeSettings

    bare = load_settings(BridgeSettings, env={})
    assert "no sink configured" in (BridgeService.unconfigured(bare) or "")
    env = {"TRAINGUARD_SLACK_WEBHOOK_URL": "hooks.slack.com/services/T/B/secret"}
    with pytest.raises(ConfigError, match=r"slack_webhook_url=.* is not an http"):
        BridgeService(load_settings(BridgeSettings, env=env))
    ok = load_settings(BridgeSettings, env={"TRAINGUARD_ALERTMANAGER_URL": "http://am:9093/"})
    assert BridgeService.unconfigured(ok) is None
    assert BridgeService(ok).sinks == {"alertmanager": "http://am:9093"}
