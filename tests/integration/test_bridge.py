"""The bridge against a real Alertmanager (Debian's) and a real local HTTP receiver.

An incident comes from the real remediator (a diagnosis published on the bus, a restart
acknowledged by the agents' own command rules, training passing the failure step), goes
to Alertmanager (listed by ``GET /api/v2/alerts``, then resolved: Alertmanager itself
notifies the receiver ``resolved``), to the CloudEvents webhook and to Slack; the delay
from each incident event to the webhook is printed. A restarted bridge pages nobody twice.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.alerting import Alertmanager, Receiver
from tests.conftest import wait_until
from tests.integration.recorder import running
from tests.integration.test_remediator_service import diagnosis, leading, seed, stage
from trainguard.contract.codec import decode_durable
from trainguard.contract.schemas import Incident, IncidentStep
from trainguard.contract.subjects import Subjects
from trainguard.runtime.bus import Bus
from trainguard.runtime.config import load_settings
from trainguard.runtime.service import Runtime
from trainguard.runtime.topology import provision, streams
from trainguard.services.bridge.service import BridgeService
from trainguard.services.bridge.settings import BridgeSettings


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver().start()
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture
def alertmanager(tmp_path: Path, receiver: Receiver) -> Iterator[Alertmanager]:
    am = Alertmanager(tmp_path, receiver.url).start()
    try:
        yield am
    finally:
        am.stop()


def bridge_settings(nats_url: str, redis_url: str, prefix: str, receiver: Receiver,
                    am: Alertmanager | None, policy: str = "") -> BridgeSettings:
    return load_settings(BridgeSettings, env={}, overrides={
        "nats_url": nats_url, "redis_url": redis_url, "prefix": prefix, "policy": policy,
        "alertmanager_url": am.url if am else "", "webhook_url": f"{receiver.url}/ce",
        "slack_webhook_url": f"{receiver.url}/slack",
        "dashboard_url": "http://dash.example:9466/"})


def our_alerts(am: Alertmanager, incident: str) -> list[dict[str, Any]]:
    return [a for a in am.alerts() if a["labels"].get("incident") == incident]


def am_resolved(receiver: Receiver, incident: str) -> bool:
    """Alertmanager's own notification says the incident's alert resolved."""
    for r in receiver.at("/am"):
        body = r.json()
        if body["status"] == "resolved" and any(a["labels"].get("incident") == incident
                                                for a in body["alerts"]):
            return True
    return False


async def incident_events(nc: Any, prefix: str, job: str) -> list[tuple[float, Incident]]:
    """Each incident revision and its publish time (``ce-time``)."""
    got: list[tuple[float, Incident]] = []

    async def cb(msg: Any) -> None:
        at = datetime.fromisoformat(msg.headers["ce-time"]).timestamp()
        got.append((at, decode_durable(msg.data, Incident)))

    await nc.subscribe(Subjects(prefix).event(job, "incident"), cb=cb)
    return got


async def test_a_drill_incident_pages_alertmanager_webhook_and_slack_then_resolves(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any, tmp_path: Path,
        receiver: Receiver, alertmanager: Alertmanager) -> None:
    agents, seen = await stage(nc, redis_url, prefix, job)
    events = await incident_events(nc, prefix, job)
    async with bridging(bridge_settings(nats_url, redis_url, prefix, receiver, alertmanager)), \
            leading(nats_url, redis_url, prefix, tmp_path,
                                        "launcher_grace_s = 0"):
        bus = Bus(nc, Subjects(prefix), source="test")
        await bus.publish_durable(Subjects(prefix).event(job, "diagnosis"), diagnosis(job, "d1"))
        await wait_until(lambda: seen, what="an incident")
        ident = seen[0].id
        firing = await wait_until(lambda: our_alerts(alertmanager, ident), timeout=20,
                                  what="the alert in Alertmanager")
        labels = firing[0]["labels"]
        assert labels["job"] == job and labels["cause"] == "process_crash"
        assert labels["severity"] == "warning" and labels["host"] == "node-b"
        assert firing[0]["status"]["state"] == "active"
        notes = firing[0]["annotations"]
        assert notes["culprit"] == "rank 3 on node-b" and "node-b" in notes["summary"]
        assert notes["dashboard"] == f"http://dash.example:9466/?job={job}&incident={ident}"
        assert notes["time_to_detect"].endswith("s")
        await wait_until(lambda: any(i.status == "mitigating" and i.mitigated_at for i in seen),
                         what="mitigated")
        await wait_until(lambda: "restart: done" in our_alerts(alertmanager, ident)[0]
                         ["annotations"]["actions"], timeout=20,
                         what="the alert to carry the action taken")
        await seed(redis_url, prefix, job, attempt=1, step=121)  # training passes the step
        await wait_until(lambda: any(i.status == "resolved" for i in seen), what="resolved")
        await wait_until(lambda: not our_alerts(alertmanager, ident), timeout=20,
                         what="the alert to leave Alertmanager's active list")
        await wait_until(lambda: am_resolved(receiver, ident), timeout=30,
                         what="Alertmanager's resolved notification")
        await wait_until(lambda: len(receiver.at("/ce")) >= 2 and len(receiver.at("/slack")) >= 2,
                         timeout=20, what="webhook and Slack: firing and resolved")
    assert agents.commands and agents.commands[0].kind == "restart"

    hooks = receiver.at("/ce")
    # One page when it opened, one when it resolved: the mitigating revisions say nothing.
    assert [h.headers["ce-tgstate"] for h in hooks] == ["firing", "resolved"]
    for h in hooks:
        assert h.headers["ce-specversion"] == "1.0"
        assert h.headers["ce-type"] == "io.trainguard.incident.v1"
        assert h.headers["ce-source"] == "trainguard/bridge"
        assert h.headers["ce-subject"] == f"{job}/{ident}"
        assert h.headers["content-type"] == "application/json"
        body = decode_durable(h.body, Incident)
        assert body.id == ident and h.headers["ce-id"] == f"{ident}.{body.rev}"
    assert decode_durable(hooks[-1].body, Incident).status == "resolved"
    slack = [h.json() for h in receiver.at("/slack")]
    assert slack[0]["text"].startswith(f"[FIRING] {job}: process_crash")
    assert slack[1]["text"].startswith(f"[RESOLVED] {job}: process_crash")
    assert "rank 3 on node-b" in slack[0]["blocks"][0]["text"]["text"]
    assert "Open the dashboard" in slack[0]["blocks"][0]["text"]["text"]

    published = {inc.rev: at for at, inc in events}
    delays = [h.at - published[decode_durable(h.body, Incident).rev] for h in hooks]
    shown = ", ".join(f"{d * 1000:.0f} ms" for d in delays)
    print(f"\nincident event -> webhook receiver: {shown}")
    assert all(d >= -1.0 for d in delays)  # clocks of one machine: sane, not a timing test


@contextlib.asynccontextmanager
async def bridging(settings: BridgeSettings) -> AsyncIterator[Runtime]:
    """A bridge whose consumer is bound: it takes new events only, so one published before
    the consumer exists would never reach it."""
    async with running(BridgeService(settings)) as rt:
        async def ready() -> bool:
            return (await rt.ready())[0]

        await wait_until(ready, what="the bridge's consumer bound")
        yield rt


async def publish(bus: Bus, prefix: str, inc: Incident) -> None:
    await bus.publish_durable(Subjects(prefix).event(inc.job, "incident"), inc)


def incident(job: str, rev: int, status: str, **kw: Any) -> Incident:
    now = time.time()
    return Incident(id="inc-1", job=job, cause="rank_hang", status=status,  # type: ignore[arg-type]
                    rev=rev, ranks=[1], hosts=["node-a"], onset_at=now - 6,
                    detected_at=now - 1, summary="rank 1 stuck in data", **kw)


@pytest.fixture
async def bus(nc: Any, prefix: str) -> AsyncIterator[Bus]:
    await provision(nc.jetstream(), streams(prefix))
    yield Bus(nc, Subjects(prefix), source="test")


async def test_a_restarted_bridge_does_not_page_twice(nats_url: str, redis_url: str,
                                                      prefix: str, job: str, bus: Bus,
                                                      receiver: Receiver) -> None:
    settings = bridge_settings(nats_url, redis_url, prefix, receiver, None)
    async with bridging(settings):
        await publish(bus, prefix, incident(job, 1, "open"))
        await wait_until(lambda: len(receiver.at("/ce")) == 1, what="the first page")
    # While it is down: the same revision again (a publisher's retry), and a mitigating one.
    await publish(bus, prefix, incident(job, 1, "open"))
    await publish(bus, prefix, incident(job, 2, "mitigating", actions=[
        IncidentStep(action="restart", status="done")]))
    async with bridging(settings) as rt:
        await publish(bus, prefix, incident(job, 1, "open"))  # and once more, replayed
        await publish(bus, prefix, incident(job, 3, "resolved", resolved_at=time.time()))
        await wait_until(lambda: len(receiver.at("/ce")) == 2, what="the resolve")
        await wait_until(lambda: rt.metrics.registry.get_sample_value(
            "trainguard_handler_seconds_count", {"service": "bridge", "consumer": "bridge"})
            == 4, what="every event handled")
    states = [h.headers["ce-tgstate"] for h in receiver.at("/ce")]
    assert states == ["firing", "resolved"]
    assert [h.headers["ce-id"] for h in receiver.at("/ce")] == ["inc-1.1", "inc-1.3"]
    assert len(receiver.at("/slack")) == 2


async def test_a_failing_sink_is_retried_without_resending_to_the_others(
        nats_url: str, redis_url: str, prefix: str, job: str, bus: Bus, receiver: Receiver,
        tmp_path: Path) -> None:
    policy = tmp_path / "policy.toml"
    policy.write_text('[notify]\nsinks = ["webhook", "slack"]\n')
    receiver.status = 503
    settings = bridge_settings(nats_url, redis_url, prefix, receiver, None, str(policy))
    async with bridging(settings) as rt:
        await publish(bus, prefix, incident(job, 1, "open"))
        await wait_until(lambda: len(receiver.got) >= 2, what="first tries")
        receiver.status = 200
        await wait_until(lambda: rt.metrics.registry.get_sample_value(
            "trainguard_notifications_total", {"sink": "slack", "outcome": "sent"}) == 1,
            timeout=30, what="the retry to get through")
        failed = rt.metrics.registry.get_sample_value(
            "trainguard_notifications_total", {"sink": "webhook", "outcome": "failed"})
        assert failed is not None and failed >= 1
    sent = [r for r in receiver.got if r.path == "/ce"]
    assert len(sent) >= 2  # the failed try and the one that got through
    assert json.loads(sent[-1].body)["id"] == "inc-1"


async def test_routes_and_rate_limits_come_from_the_policy_file(
        nats_url: str, redis_url: str, prefix: str, job: str, bus: Bus, receiver: Receiver,
        tmp_path: Path) -> None:
    """Hangs go to Slack only; at most one page per job and cause per hour."""
    policy = tmp_path / "policy.toml"
    policy.write_text('[notify]\nsinks = ["webhook"]\nrate_limit = 1\n'
                      '[[notify.routes]]\ncauses = ["rank_hang"]\nsinks = ["slack"]\n')
    settings = bridge_settings(nats_url, redis_url, prefix, receiver, None, str(policy))
    async with bridging(settings) as rt:
        await publish(bus, prefix, incident(job, 1, "open"))
        second = incident(job, 1, "open")
        second.id = "inc-2"
        await publish(bus, prefix, second)
        other = incident(job, 1, "open")
        other.id, other.cause = "inc-3", "oom"
        await publish(bus, prefix, other)
        await wait_until(lambda: rt.metrics.registry.get_sample_value(
            "trainguard_notifications_total", {"sink": "slack", "outcome": "suppressed"}) == 1,
            what="the second hang page held back")
        await wait_until(lambda: receiver.at("/ce"), what="the oom page on the default route")
    assert len(receiver.at("/slack")) == 1
    assert "inc-3" in receiver.at("/ce")[0].headers["ce-subject"]


async def test_a_sink_that_refuses_for_good_is_recorded_not_retried(
        nats_url: str, redis_url: str, prefix: str, job: str, bus: Bus,
        receiver: Receiver) -> None:
    """A 4xx (a revoked Slack hook, say) would be refused again: counted, logged, and the
    revision is settled instead of being retried for ever."""
    receiver.status = 404
    settings = bridge_settings(nats_url, redis_url, prefix, receiver, None)
    async with bridging(settings) as rt:
        await publish(bus, prefix, incident(job, 1, "open"))
        svc = rt.service
        assert isinstance(svc, BridgeService)

        async def settled() -> bool:
            sent = await svc.records.load(job, "inc-1")
            return sent is not None and sent.revs == {"webhook": 1, "slack": 1}

        await wait_until(settled, what="the revision settled for both sinks")
        assert rt.metrics.registry.get_sample_value(
            "trainguard_notifications_total", {"sink": "webhook", "outcome": "failed"}) == 1
    assert len(receiver.at("/ce")) == 1 and len(receiver.at("/slack")) == 1


async def test_an_escalation_replaces_the_warning_alert_and_stays_firing(
        nats_url: str, redis_url: str, prefix: str, job: str, bus: Bus, receiver: Receiver,
        alertmanager: Alertmanager) -> None:
    """Severity is a label, so escalating is a new alert: the warning one is resolved, the
    critical one fires (and is kept firing: nothing will resolve an escalated incident)."""
    settings = bridge_settings(nats_url, redis_url, prefix, receiver, alertmanager)
    async with bridging(settings) as rt:
        await publish(bus, prefix, incident(job, 1, "open"))
        await wait_until(lambda: [a["labels"]["severity"] for a in our_alerts(
            alertmanager, "inc-1")] == ["warning"], timeout=20, what="the warning alert")
        await publish(bus, prefix, incident(job, 2, "escalated",
                                            escalation="restart budget spent"))
        await wait_until(lambda: [a["labels"]["severity"] for a in our_alerts(
            alertmanager, "inc-1")] == ["critical"], timeout=20,
            what="only the critical alert active")
        svc = rt.service
        assert isinstance(svc, BridgeService)
        assert await svc.records.firing() == [(job, "inc-1")]
    alert = our_alerts(alertmanager, "inc-1")[0]
    assert "escalated: restart budget spent" in alert["annotations"]["summary"]
    assert [h.headers["ce-tgstate"] for h in receiver.at("/ce")] == ["firing", "escalated"]
    assert receiver.at("/ce")[1].headers["ce-tgseverity"] == "critical"


async def test_firing_alerts_are_reposted_until_resolved(
        nats_url: str, redis_url: str, prefix: str, job: str, bus: Bus, receiver: Receiver,
        tmp_path: Path) -> None:
    """Alertmanager drops an alert not re-posted within its resolve_timeout: the bridge
    re-posts each firing one every repeat_s (here the receiver stands in for it)."""
    policy = tmp_path / "policy.toml"
    policy.write_text('[notify]\nsinks = ["alertmanager"]\nrepeat_s = 0.2\n')
    settings = load_settings(BridgeSettings, env={}, overrides={
        "nats_url": nats_url, "redis_url": redis_url, "prefix": prefix, "policy": str(policy),
        "alertmanager_url": receiver.url})
    async with bridging(settings) as rt:
        await publish(bus, prefix, incident(job, 1, "open"))
        posts = await wait_until(lambda: receiver.at("/api/v2/alerts")
                                 if len(receiver.at("/api/v2/alerts")) >= 3 else None,
                                 what="the alert re-posted")
        assert all(p.json() == posts[0].json() for p in posts)  # the same alert, as is
        assert "endsAt" not in posts[0].json()[0]
        await publish(bus, prefix, incident(job, 2, "resolved", resolved_at=time.time()))
        await wait_until(lambda: any("endsAt" in p.json()[0]
                                     for p in receiver.at("/api/v2/alerts")), what="resolved")
        svc = rt.service
        assert isinstance(svc, BridgeService)
        assert await svc.records.firing() == []
