"""The three wire formats: Alertmanager v2 alerts, CloudEvents binary mode, Slack.

Each is a pure function of a :class:`~.rules.Notice`; :mod:`.sinks` sends them.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from trainguard.contract.codec import encode_durable
from trainguard.contract.envelope import SPEC_VERSION
from trainguard.contract.schemas import Incident

from .rules import Notice

CE_SOURCE = "trainguard/bridge"


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds") \
        .replace("+00:00", "Z")


def latest_time(inc: Incident) -> float:
    """When this revision happened: the newest of the incident's timestamps."""
    marks = [t for t in (inc.onset_at, inc.detected_at, inc.diagnosed_at, inc.first_action_at,
                         inc.mitigated_at, inc.resolved_at) if t is not None]
    marks += [s.at for s in inc.actions if s.at is not None]
    return max(marks) if marks else time.time()


@dataclass(frozen=True)
class Request:
    """One HTTP POST: body and headers."""

    body: bytes
    headers: dict[str, str]


def alert(n: Notice, labels: dict[str, str], *, ends_at: float | None = None) -> dict[str, object]:
    """One alert of ``POST /api/v2/alerts``. ``ends_at`` resolves it; without it the alert
    fires until Alertmanager's ``resolve_timeout`` unless re-posted."""
    inc = n.incident
    body: dict[str, object] = {
        "labels": labels,
        "annotations": {k: v for k, v in {
            "summary": n.summary,
            "culprit": n.culprit,
            "actions": n.actions,
            "time_to_detect": n.time_to_detect,
            "time_to_mitigate": n.time_to_mitigate,
            "steps_lost": "" if inc.steps_lost is None else str(inc.steps_lost),
            "status": inc.status,
            "dashboard": n.dashboard,
        }.items() if v},
        "startsAt": rfc3339(inc.detected_at or inc.onset_at or latest_time(inc)),
    }
    if n.dashboard:
        body["generatorURL"] = n.dashboard
    if ends_at is not None:
        body["endsAt"] = rfc3339(ends_at)
    return body


def alertmanager(alerts: list[dict[str, object]]) -> Request:
    return Request(json.dumps(alerts).encode(), {"Content-Type": "application/json"})


def cloudevent(n: Notice) -> Request:
    """CloudEvents 1.0, HTTP binary mode: attributes in ``ce-*`` headers, the body the
    incident as on the bus. ``ce-id`` is the incident and revision, so a receiver can
    dedupe a redelivery; the ``tg*`` extensions say what changed."""
    inc = n.incident
    headers = {
        "Content-Type": "application/json",
        "ce-specversion": SPEC_VERSION,
        "ce-id": f"{inc.id}.{inc.rev}",
        "ce-source": CE_SOURCE,
        "ce-type": inc.ce_type(),
        "ce-subject": f"{inc.job}/{inc.id}",
        "ce-time": rfc3339(latest_time(inc)),
        "ce-tgstate": n.state,
        "ce-tgseverity": n.severity,
    }
    if n.dashboard:
        headers["ce-tgdashboard"] = n.dashboard
    return Request(encode_durable(inc), headers)


def slack(n: Notice) -> Request:
    """A Slack incoming-webhook message: ``text`` for notifications, blocks for reading."""
    lines = [
        f"*{n.title}*",
        n.summary,
        f"*Culprit:* {n.culprit}",
        f"*Actions:* {n.actions}",
    ]
    timing = ", ".join(p for p in (
        f"detected in {n.time_to_detect}" if n.time_to_detect else "",
        f"mitigated in {n.time_to_mitigate}" if n.time_to_mitigate else "",
        f"{n.incident.steps_lost} steps lost" if n.incident.steps_lost else "") if p)
    if timing:
        lines.append(f"*Times:* {timing}")
    if n.dashboard:
        lines.append(f"<{n.dashboard}|Open the dashboard>")
    text = "\n".join(lines)
    body = {"text": n.title,
            "blocks": [{"type": "section", "text": {"type": "mrkdwn", "text": text}}]}
    return Request(json.dumps(body).encode(), {"Content-Type": "application/json"})
