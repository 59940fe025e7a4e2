"""``trainguard incidents show ID``: one incident as on-call reads it.

Pure rendering (no I/O, tested as is): the incident record from Redis, and the diagnoses
and anomalies it names from the event history, become a timeline (onset, detected,
diagnosed, first action, mitigated, resolved), the evidence behind its cause and each step
of its plan with status, time, commands and detail.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from typing import Any

import msgspec

from trainguard.contract.errors import TrainguardError
from trainguard.contract.schemas import Anomaly, Diagnosis, Incident


class UnknownIncident(TrainguardError, LookupError):
    """No incident, or more than one, has the id (or id prefix) asked for."""


def pick(incidents: Iterable[Incident], ident: str) -> Incident:
    """The incident whose id is ``ident`` or, failing that, the one it is a prefix of."""
    found = list(incidents)
    exact = [i for i in found if i.id == ident]
    if exact:
        return exact[0]
    prefixed = [i for i in found if i.id.startswith(ident)]
    if len(prefixed) == 1:
        return prefixed[0]
    if not prefixed:
        raise UnknownIncident(f"no incident {ident!r} (see `trainguard incidents`)")
    raise UnknownIncident(f"{ident!r} matches {len(prefixed)} incidents "
                          f"({', '.join(sorted(i.id for i in prefixed))}): give more of the id")


def clock(t: float | None) -> str:
    """A wall-clock time with milliseconds, UTC (what the event headers carry too)."""
    if not t:
        return "-"
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%H:%M:%S.%f")[:-3]


def timeline(inc: Incident) -> list[tuple[str, float]]:
    """The incident's moments that happened, in time order."""
    moments = [("onset", inc.onset_at), ("detected", inc.detected_at),
               ("diagnosed", inc.diagnosed_at), ("first action", inc.first_action_at),
               ("mitigated", inc.mitigated_at), ("resolved", inc.resolved_at)]
    return sorted(((name, t) for name, t in moments if t), key=lambda m: m[1])


def _value(v: Any) -> str:
    text = v if isinstance(v, str) else msgspec.json.encode(v).decode()
    return text if len(text) <= 120 else text[:117] + "..."


def render(inc: Incident, diagnoses: Iterable[Diagnosis],
           anomalies: Iterable[Anomaly]) -> list[str]:
    """The lines of ``trainguard incidents show``."""
    out = [f"incident {inc.id}  job {inc.job}  cause {inc.cause}  status {inc.status}  "
           f"rev {inc.rev}"]
    if inc.summary:
        out.append(f"summary: {inc.summary}")
    out.append(f"culprit: ranks {','.join(map(str, inc.ranks)) or '-'}  "
               f"hosts {','.join(inc.hosts) or '-'}")
    if inc.signature:
        out.append(f"signature: {inc.signature}")
    if inc.escalation:
        out.append(f"escalation: {inc.escalation}")
    out.append("timeline:")
    first = None
    for name, t in timeline(inc):
        first = first or t
        out.append(f"  {clock(t)}  {name:<13} +{t - first:.1f}s")
    steps = [f"failure step {inc.failure_step}" if inc.failure_step is not None else "",
             f"resumed at step {inc.resume_step}" if inc.resume_step is not None else "",
             f"steps lost {inc.steps_lost}" if inc.steps_lost is not None else ""]
    if any(steps):
        out.append("  " + ", ".join(s for s in steps if s))
    out.append("evidence:")
    shown = 0
    for d in diagnoses:
        shown += 1
        out.append(f"  diagnosis {d.id} {d.cause} (confidence {d.confidence:.2f}, "
                   f"{d.status}): {d.summary or '-'}")
        out.extend(f"    - {e.fact} [{e.source}]" + (f": {_value(e.value)}"
                                                      if e.value is not None else "")
                   for e in d.evidence)
    for a in anomalies:
        shown += 1
        ev = {k: v for k, v in msgspec.to_builtins(a.evidence).items() if v not in (None, [], {})}
        out.append(f"  anomaly {a.id} {a.kind} ranks {','.join(map(str, a.ranks)) or '-'} "
                   f"step {a.step if a.step is not None else '-'} ({a.status})"
                   + (f": {_value(ev)}" if ev else ""))
    if not shown:
        out.append("  (none in the event history)")
    out.append("actions:")
    for n, step in enumerate(inc.actions, 1):
        cmds = f" commands {','.join(step.command_ids)}" if step.command_ids else ""
        out.append(f"  {n}. {step.action:<9} {step.status:<8} {clock(step.at)}{cmds}"
                   + (f"  {step.detail}" if step.detail else ""))
    if not inc.actions:
        out.append("  (none)")
    return out
