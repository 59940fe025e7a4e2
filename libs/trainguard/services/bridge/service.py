"""The bridge's async shell: incident events in; Alertmanager, webhook and Slack out.

One durable consumer (``bridge``) on ``tg.*.event.incident``, new events only (a new bridge
does not page for last week's history). For each revision, :mod:`.rules` decides which
configured sink should hear of it (:mod:`.routes` picks the sinks), :mod:`.payloads` says
it in each sink's format, and :mod:`.record` remembers in Redis what each sink got before
the message is acknowledged: at least once, and a redelivery, a replay or a restarted
bridge sends nothing twice. A sink that fails gets the revision again on redelivery
(``Retry``); sinks that took it are not asked again.

Alertmanager forgets an alert that is not re-posted within its ``resolve_timeout``, so a
timer re-posts every firing alert each ``repeat_s``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from prometheus_client import Counter, Histogram

from trainguard.contract.errors import ConfigError, NotStarted, Retry
from trainguard.contract.schemas import Incident
from trainguard.runtime.config import Settings
from trainguard.runtime.logs import get_logger
from trainguard.runtime.service import Consumer, Delivery, Runtime, Service
from trainguard.runtime.topology import ConsumerSpec

from . import payloads
from .record import SentRecords
from .routes import NotifyPolicy, RateLimiter, group_of, load_notify, sinks_for
from .rules import Notice, Sent, labels_of, notice, state_of, wants
from .settings import BridgeSettings
from .sinks import SinkError, check_url, post

log = get_logger("trainguard.bridge")

URL_SETTINGS = {"alertmanager": "alertmanager_url", "webhook": "webhook_url",
                "slack": "slack_webhook_url"}
DELAY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)


def configured_sinks(settings: BridgeSettings) -> dict[str, str]:
    """Sink → URL for each sink whose URL is set (checked: a bad one is a ConfigError)."""
    return {sink: check_url(field, getattr(settings, field))
            for sink, field in URL_SETTINGS.items() if getattr(settings, field)}


class BridgeService(Service[BridgeSettings]):
    name = "bridge"
    settings_type = BridgeSettings

    def __init__(self, settings: BridgeSettings) -> None:
        if not isinstance(settings, BridgeSettings):
            raise ConfigError("BridgeService needs BridgeSettings "
                              f"(got {type(settings).__name__})")
        super().__init__(settings)
        self.sinks = configured_sinks(settings)
        self.policy: NotifyPolicy = load_notify(settings.policy or None)
        self.limiter = RateLimiter(self.policy.rate_limit, self.policy.rate_window_s)
        self._records: SentRecords | None = None
        self._sent: Counter | None = None
        self._delay: Histogram | None = None

    @classmethod
    def unconfigured(cls, settings: Settings) -> str | None:
        if isinstance(settings, BridgeSettings) and configured_sinks(settings):
            return None
        return ("no sink configured: set TRAINGUARD_ALERTMANAGER_URL, TRAINGUARD_WEBHOOK_URL "
                "or TRAINGUARD_SLACK_WEBHOOK_URL")

    @property
    def records(self) -> SentRecords:
        if self._records is None:
            raise NotStarted(self.name)
        return self._records

    def consumers(self) -> Sequence[Consumer]:
        s = self.settings.subjects
        return [Consumer(ConsumerSpec("events", "bridge", (s.pattern("event", tail="incident"),),
                                      deliver_new=True), self.on_incident, (Incident,))]

    async def start(self, rt: Runtime) -> None:
        self._records = SentRecords(rt.redis, self.settings.prefix)
        self._sent = Counter("trainguard_notifications",
                             "Notifications by sink and outcome (sent, failed, suppressed by "
                             "the rate limit)", ["sink", "outcome"], registry=rt.metrics.registry)
        self._delay = Histogram("trainguard_notification_delay_seconds",
                                "From the incident event's publish to the sink's answer",
                                ["sink"], buckets=DELAY_BUCKETS, registry=rt.metrics.registry)
        for sink in self.sinks:  # every series exists from the start (alerts can say 0)
            for outcome in ("sent", "failed", "suppressed"):
                self._sent.labels(sink, outcome)
        rt.every(self.policy.repeat_s, self._repost, "repost")
        log.info("bridge: notifying %s", ", ".join(sorted(self.sinks)))

    async def ready(self) -> tuple[bool, str]:
        return True, f"ready (sinks: {', '.join(sorted(self.sinks))})"

    # -- one incident revision -----------------------------------------------------------
    async def on_incident(self, inc: Incident, delivery: Delivery) -> None:
        sent = await self.records.load(inc.job, inc.id) or Sent(job=inc.job, incident=inc.id)
        n = notice(inc, self.settings.dashboard_url)
        published = _event_time(delivery.headers)
        failed: list[str] = []
        for sink in sinks_for(self.policy, inc.job, inc.cause, n.severity,
                              frozenset(self.sinks)):
            if not wants(sent, sink, inc):
                continue
            delivered = True
            try:
                await self._deliver(sink, n, sent)
            except SinkError as exc:
                self._count(sink, "failed")
                log.bind(job=inc.job, incident=inc.id).warning(
                    "notifying %s of incident %s rev %d failed%s: %s", sink, inc.id, inc.rev,
                    " for good (the sink refused it)" if exc.permanent else "; will retry", exc)
                if not exc.permanent:
                    failed.append(sink)
                    continue
                delivered = False  # refused for good: recorded, so not sent again
            sent.revs[sink] = inc.rev
            await self.records.save(sent, firing=bool(sent.labels))
            if delivered and published is not None and self._delay is not None:
                self._delay.labels(sink).observe(max(0.0, time.time() - published))
        if failed:
            raise Retry(min(30.0, 2.0 ** delivery.deliveries))

    async def _deliver(self, sink: str, n: Notice, sent: Sent) -> None:
        """Send ``n`` to ``sink`` and note in ``sent`` what it now holds (saved by the
        caller once it took it)."""
        if sink == "alertmanager":
            await self._alertmanager(n, sent)
            return
        state = state_of(n.incident)
        labels = labels_of(n.incident, n.severity)
        if state == "firing" and not self.limiter.allow(
                f"{sink}|{group_of(self.policy, labels)}", time.time()):  # each sink its own
            sent.states[sink] = state
            if sink not in sent.suppressed:
                sent.suppressed.append(sink)
            self._count(sink, "suppressed")
            return
        req = payloads.cloudevent(n) if sink == "webhook" else payloads.slack(n)
        await post(sink, self.sinks[sink], req, self.settings.http_timeout)
        sent.states[sink] = state
        self._count(sink, "sent")

    async def _alertmanager(self, n: Notice, sent: Sent) -> None:
        inc, now = n.incident, time.time()
        state = state_of(inc)
        alerts: list[dict[str, object]] = []
        if state == "resolved":
            if sent.labels:  # resolve exactly the label set that fired
                alerts.append(payloads.alert(n, sent.labels, ends_at=inc.resolved_at or now))
            sent.labels, sent.alert, sent.firing_until = {}, "", 0.0
        else:
            labels = labels_of(inc, n.severity)
            if sent.labels and sent.labels != labels:  # severity or hosts moved: a new alert
                alerts.append(payloads.alert(n, sent.labels, ends_at=now))
            firing = payloads.alert(n, labels)
            alerts.append(firing)
            sent.labels = labels
            sent.alert = payloads.alertmanager([firing]).body.decode()
            sent.firing_until = now + self.policy.firing_ttl_s \
                if state in ("escalated", "failed") else 0.0
        sent.states["alertmanager"] = state
        if alerts:
            await post("alertmanager", self._am_url(), payloads.alertmanager(alerts),
                       self.settings.http_timeout)
            self._count("alertmanager", "sent")

    def _am_url(self) -> str:
        return f"{self.sinks['alertmanager']}/api/v2/alerts"

    # -- keeping firing alerts alive ------------------------------------------------------
    async def _repost(self) -> None:
        if "alertmanager" not in self.sinks:
            return
        now = time.time()
        for job, ident in await self.records.firing():
            sent = await self.records.load(job, ident)
            if sent is None or not sent.alert or (sent.firing_until and now > sent.firing_until):
                await self.records.stop_firing(job, ident)  # lapses in Alertmanager
                continue
            try:
                await post("alertmanager", self._am_url(),
                           payloads.Request(sent.alert.encode(),
                                            {"Content-Type": "application/json"}),
                           self.settings.http_timeout)
            except SinkError as exc:
                log.warning("re-posting the alert of incident %s failed: %s", ident, exc)
                return  # Alertmanager is down: try them all next round

    def _count(self, sink: str, outcome: str) -> None:
        if self._sent is not None:
            self._sent.labels(sink, outcome).inc()


def _event_time(headers: dict[str, Any]) -> float | None:
    raw = headers.get("ce-time")
    if not raw:
        return None
    try:
        return datetime.fromisoformat(str(raw)).timestamp()
    except ValueError:
        return None
