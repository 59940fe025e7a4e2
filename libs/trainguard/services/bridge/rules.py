"""Incident → notification: what is said, to whom, and whether it was said already.

Pure functions over an :class:`~trainguard.contract.schemas.Incident` and the :class:`Sent` record
of what each sink already got (kept in Redis by the service), so a redelivered or replayed
revision, or a restarted bridge, pages nobody twice:

* a sink gets a revision at most once (``rev`` not above the one it got: skipped);
* Alertmanager gets every new revision (its alert's annotations follow the incident; the
  same labels are the same alert), and a ``resolved`` one with ``endsAt``;
* the webhook and Slack get a message only when the incident's *state* changes: ``firing``
  (open or mitigating), ``escalated``, ``failed``, ``resolved``: one page when it opens, one
  when a human is needed, one when it is over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

import msgspec

from trainguard.contract.schemas import Incident, Severity
from trainguard.runtime.jobmetrics import phase_durations

State = Literal["firing", "escalated", "failed", "resolved"]
ALERTNAME: Final = "TrainguardIncident"
HUMAN_CAUSES: Final = frozenset({"unknown"})
"""Causes whose plan is a person: paged as critical from the start."""


class Sent(msgspec.Struct, kw_only=True):
    """What each sink got of one incident (the dedupe record)."""

    job: str
    incident: str
    revs: dict[str, int] = {}
    states: dict[str, str] = {}
    labels: dict[str, str] = {}
    """The label set Alertmanager holds as firing (empty: none)."""
    alert: str = ""
    """The last alert posted (JSON), re-posted while firing."""
    firing_until: float = 0.0
    """Re-post until then (0: while the incident is open)."""
    suppressed: list[str] = []
    """Push sinks whose firing page the rate limit held back: their resolve stays quiet."""


def state_of(inc: Incident) -> State:
    if inc.status == "resolved":
        return "resolved"
    if inc.status in ("escalated", "failed"):
        return inc.status
    return "firing"


def severity_of(inc: Incident) -> Severity:
    """critical when a person must act (escalated, failed, an unknown cause, or an
    ``escalate`` step in the plan), info once resolved, warning otherwise."""
    if inc.status == "resolved":
        return "info"
    if inc.status in ("escalated", "failed") or inc.cause in HUMAN_CAUSES \
            or any(s.action == "escalate" for s in inc.actions):
        return "critical"
    return "warning"


def labels_of(inc: Incident, severity: Severity) -> dict[str, str]:
    """Alertmanager labels: the alert's identity. ``severity`` is fixed by the caller (a
    resolve must name the labels that fired)."""
    return {
        "alertname": ALERTNAME,
        "job": inc.job,
        "cause": inc.cause,
        "severity": severity,
        "host": ",".join(sorted(set(inc.hosts))),
        "incident": inc.id,
    }


def culprit(inc: Incident) -> str:
    ranks = ", ".join(str(r) for r in sorted(inc.ranks))
    hosts = ", ".join(sorted(set(inc.hosts)))
    who = " on ".join(p for p in (f"rank {ranks}" if ranks else "", hosts) if p)
    return who or "unknown"


def observe_only(inc: Incident) -> bool:
    """Some step was only observed (the job's observe-only mode): the page says what
    trainguard would have done, and that it did not."""
    return any(s.status == "observed" for s in inc.actions)


def actions_text(inc: Incident) -> str:
    """Each step and how it went; an observed one as what it would have done."""
    return "; ".join(f"{s.action}: {s.detail or 'would have run it'} (observe-only)"
                     if s.status == "observed" else
                     f"{s.action}: {s.status}" + (f" ({s.detail})" if s.detail else "")
                     for s in inc.actions) or "none yet"


def seconds(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}s"


def dashboard_link(base: str, inc: Incident) -> str:
    if not base:
        return ""
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}job={inc.job}&incident={inc.id}"


@dataclass(frozen=True)
class Notice:
    """Everything a message about one incident revision says, sink-neutral."""

    incident: Incident
    state: State
    severity: Severity
    summary: str
    culprit: str
    actions: str
    time_to_detect: str
    time_to_mitigate: str
    dashboard: str

    @property
    def title(self) -> str:
        word = {"firing": "FIRING", "escalated": "ESCALATED", "failed": "FAILED",
                "resolved": "RESOLVED"}[self.state]
        mode = " [OBSERVE-ONLY]" if observe_only(self.incident) else ""
        return f"[{word}]{mode} {self.incident.job}: {self.incident.cause} ({self.culprit})"


def notice(inc: Incident, dashboard_url: str = "") -> Notice:
    phases = phase_durations(inc)
    summary = inc.summary or f"{inc.cause} on job {inc.job}"
    if inc.signature and inc.signature not in summary:
        summary = f"{summary} | {inc.signature}"
    if inc.escalation:
        summary = f"{summary} | escalated: {inc.escalation}"
    if observe_only(inc):
        summary = f"{summary} | observe-only: trainguard carried out none of its decisions"
    return Notice(incident=inc, state=state_of(inc), severity=severity_of(inc),
                  summary=summary, culprit=culprit(inc), actions=actions_text(inc),
                  time_to_detect=seconds(phases.get("detect")),
                  time_to_mitigate=seconds(phases.get("mitigate")),
                  dashboard=dashboard_link(dashboard_url, inc))


def fresh(sent: Sent | None, sink: str, rev: int) -> bool:
    """True when ``sink`` has not had revision ``rev`` (or a later one) of the incident."""
    return sent is None or sent.revs.get(sink, 0) < rev


def wants(sent: Sent | None, sink: str, inc: Incident) -> bool:
    """Whether ``sink`` should hear about this revision."""
    if not fresh(sent, sink, inc.rev):
        return False
    if sink == "alertmanager":
        return True
    last = sent.states.get(sink) if sent else None
    state = state_of(inc)
    if last is None and state == "resolved":
        return False  # never told it opened (routed elsewhere or before our time)
    if state == "resolved" and sent is not None and sink in sent.suppressed:
        return False  # its page was held back: so is the all-clear
    return last != state
