"""What a node's pre-flight record does, as the policy's ``[preflight]`` says: pure.

A node that failed is blocklisted before it joins (``isolate``: the same entry an
isolation writes, cause ``preflight``, the failed checks as its reason, the remediator's
``blocklist_ttl``), so every launcher of any job refuses it at start and the isolate hook
takes it out of the scheduler too; or the failure is only announced (``alert``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainguard.contract.envelope import uuid7
from trainguard.contract.schemas import Action, PreflightReport
from trainguard.runtime.state import BlocklistEntry

from .policy import Policy

CAUSE = "preflight"


@dataclass(frozen=True)
class Gate:
    action: Literal["isolate", "alert"]
    reason: str


MAX_AGE_S = 300.0
"""A record older than this (redelivered after an outage, after an ``unblock``) is history:
it is announced, never acted on."""


def decide(report: PreflightReport, policy: Policy, now: float) -> Gate | None:
    """The policy's answer to ``report`` (None: nothing to do). Only a node's record from
    before its ranks start (``trigger="launch"``), and a fresh one, keeps it out: a check
    re-run on a training node (a command, ``trainguard preflight --publish``) or an old
    record alerts instead."""
    if report.status == "fail" and policy.preflight.on_fail != "none":
        why = f"preflight failed on {report.host}: {report.reason()}"
        gating = report.trigger == "launch" and now - report.time <= MAX_AGE_S
        return Gate(policy.preflight.on_fail if gating else "alert", why)
    if report.status == "warn" and policy.preflight.on_warn == "alert":
        warned = "; ".join(f"{c.name}: {c.reason}" for c in report.checks if c.status == "warn")
        return Gate("alert", f"preflight warned on {report.host}: {warned}")
    return None


def blocklist_entry(report: PreflightReport, gate: Gate, now: float,
                    ttl: float) -> BlocklistEntry:
    return BlocklistEntry(reason=gate.reason, cause=CAUSE, job=report.job, incident="",
                          time=now, expires=now + ttl if ttl else 0.0)


def action_event(report: PreflightReport, gate: Gate, now: float) -> Action:
    """The event on-call and alerting tools see (``tg.<job>.event.action``)."""
    return Action(id=uuid7(), job=report.job, action=gate.action, status="acked",
                  detail=(f"host {report.host} blocklisted before joining: " if
                          gate.action == "isolate" else "") + gate.reason, time=now)
