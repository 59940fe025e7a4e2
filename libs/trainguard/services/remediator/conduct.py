"""Running an incident's steps: pure, like :mod:`.engine` (the shell, :mod:`.service`,
loads, sends, waits and saves).

The executor asks :func:`next_move` what to do with an incident now: nothing (it ended or
just concluded), wait out an escalation's grace, or run a step (started now). A step to
run is :func:`act`: its outcome at once (``alert``, ``escalate``, an unknown action, a
restart a reload in place made moot), a call to the checkpoint coordinator
(:class:`Save`, :class:`Rollback`), a command for the agents (:class:`Send`,
:class:`Isolate`), or a look at the job first (:class:`Restart`: waits, then
:func:`restart`; :class:`Hold`: :func:`hold`). The acks of a command are judged by
:func:`judge`, a rollback's reload in place by :func:`reload` and :func:`reloaded`; what a
finished step means for its incident is :func:`.engine.finish_step`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from trainguard.contract.rpc import MEMORY_ONLY, RollbackReply
from trainguard.contract.schemas import CommandAck, HookRun, Incident, IncidentStep

from . import hooks, recovery
from .endings import moot
from .engine import (
    JobView,
    Outcome,
    ack_verdict,
    conclude,
    grace_to_wait,
    is_open,
    launcher_restarted,
    named,
    next_step,
    skip_restart,
    start_step,
    waits_for_launcher,
)
from .policy import Policy

SENDS: Final = 2
"""A command is sent, and sent again once as a retry when :func:`judge` says so."""


# -- the executor's next move ------------------------------------------------------------

@dataclass(frozen=True)
class Move:
    """What the executor does with an incident now."""

    index: int | None = None
    """The step to run (started by :func:`next_move`) or to wait for; None: nothing more
    to run (the incident ended, or no step is left)."""
    grace: float = 0.0
    """Seconds to wait (unlocked) before that step: an escalation's grace."""
    save: bool = False
    """The incident concluded now (:func:`.engine.conclude`): save it as a new revision."""


def next_move(inc: Incident | None, now: float) -> Move:
    """The next move for ``inc`` as saved (None: it is gone)."""
    if inc is None or not is_open(inc):
        return Move()
    index = next_step(inc)
    if index is None:
        return Move(save=conclude(inc, now))
    step = inc.actions[index]
    grace = grace_to_wait(step)
    if grace:
        return Move(index, grace)
    start_step(inc, step, now)
    return Move(index)


def waited(fresh: Incident, before: Incident, index: int) -> bool:
    """Mark step ``index``'s grace as waited out on ``fresh`` (the incident as saved now),
    unless it was re-planned since ``before``; True: save it (no new revision)."""
    if fresh.actions != before.actions:
        return False  # re-planned meanwhile: the executor runs what is planned now
    fresh.actions[index].params["waited"] = True
    return True


# -- what a step needs done --------------------------------------------------------------

@dataclass(frozen=True)
class Save:
    """Save now, through the checkpoint coordinator, within ``deadline`` seconds."""

    deadline: float


@dataclass(frozen=True)
class Rollback:
    """Point the job's resume pointer below ``below_step`` (then :func:`reload_point`)."""

    below_step: int


@dataclass(frozen=True)
class Send:
    """A command for the agents, judged by the acks of ``hosts`` (:func:`judge`)."""

    kind: str
    hosts: list[str]
    """Who must acknowledge it."""
    params: dict[str, Any] = field(default_factory=dict)
    host: str | None = None
    """To this host's agent (``cmd.host.<host>``); None: to everyone (``cmd.all``)."""
    retry_of: str | None = None
    """The step's last command: a step sent before (by a leader that stopped, or before a
    pause) is sent again as a retry, which agents answer without running it twice."""
    counts: bool = False
    """Once sent, an ended attempt of the job counts against its restart budget."""
    attempt: int | None = None
    """The generation of the group it ends (None: unknown, each one counts)."""

    @property
    def everyone(self) -> bool:
        return self.host is None


@dataclass(frozen=True)
class Isolate:
    """Block ``send.host``, run the isolate hook beside the agent's ``isolate``
    (:func:`note_hook`), then count the attempt the isolation ends."""

    send: Send


@dataclass(frozen=True)
class Fence:
    """Hosts lost together (one failure domain): block each and run the isolate hook for
    each, then tell their agents, answered or not (``send.hosts`` are lost: none is
    awaited), and count the one attempt their loss ends."""

    hosts: list[str]
    send: Send


@dataclass(frozen=True)
class SendEach:
    """One command per host (``sends``, each to its host), all sent at once, their acks
    awaited together under one deadline and judged as one step; not sent again (evidence:
    the recovery after it goes on either way)."""

    sends: list[Send]

    @property
    def hosts(self) -> list[str]:
        return [h for s in self.sends for h in s.hosts]


@dataclass(frozen=True)
class Restart:
    """Look at the job: wait as :func:`restart_waits` says, then :func:`restart`."""


@dataclass(frozen=True)
class Hold:
    """Look at the job, then :func:`hold`."""


Act = Outcome | Save | Rollback | Send | SendEach | Isolate | Fence | Restart | Hold


def _send(step: IncidentStep, kind: str, hosts: list[str], params: dict[str, Any] | None = None,
          *, host: str | None = None, counts: bool = False,
          attempt: int | None = None) -> Send:
    return Send(kind, hosts, {k: v for k, v in (params or {}).items() if v is not None},
                host=host, retry_of=step.command_ids[-1] if step.command_ids else None,
                counts=counts, attempt=attempt)


def act(inc: Incident, step: IncidentStep) -> Act:
    """What running ``step`` of ``inc`` takes (a bad parameter raises: the step fails)."""
    match step.action:
        case "alert":
            return Outcome("done", f"alert: {inc.summary}")
        case "escalate":
            return Outcome("done", str(step.params.get("reason", "escalated to a human")))
        case "save_now":
            return Save(float(step.params.get("deadline", 60)))
        case "rollback":
            return Rollback(int(step.params.get("below_step", 0)))
        case "dump" if step.params.get("hosts"):
            params = {"ranks": step.params.get("ranks")}
            return SendEach([Send("dump", [str(h)], {k: v for k, v in params.items()
                                                     if v is not None}, host=str(h))
                             for h in step.params["hosts"]])
        case "dump":
            host = str(step.params["host"])
            return _send(step, "dump", [host], {"ranks": step.params.get("ranks")}, host=host)
        case "isolate" if "hosts" in step.params:
            hosts = [str(h) for h in step.params["hosts"]]
            return Fence(hosts, _send(step, "isolate", hosts, counts=True,
                                      attempt=inc.failure_generation))
        case "isolate":
            host = str(step.params["host"])
            return Isolate(_send(step, "isolate", [host], host=host, counts=True))
        case "restart":
            if recovery.rolled_back_in_place(inc):
                return Outcome("skipped", "rolled back in place on every rank: no process "
                                          "restarted")
            return Restart()
        case "hold":
            return Hold()
        case _:
            return Outcome("skipped", f"unknown action {step.action}")


# -- observe-only ------------------------------------------------------------------------

def would(act: Act) -> str | None:
    """What carrying out ``act`` would have done, as a page reads it; None for what has no
    effect of its own (an outcome, or a look at the job that leads to one of these)."""
    match act:
        case Save(deadline):
            return f"would have saved a checkpoint now (deadline {deadline:g}s)"
        case Rollback(below_step):
            return f"would have rolled the job back below step {below_step}"
        case Isolate(send):
            return (f"would have isolated {send.host} (blocklisted it, run the isolate hook "
                    "and told its agent)")
        case Fence(hosts):
            return (f"would have isolated {len(hosts)} hosts lost together "
                    f"({', '.join(hosts)}): blocklisted them, run the isolate hook for each "
                    "and told their agents")
        case SendEach(sends) if sends:
            args = " ".join(f"{k}={v}" for k, v in sorted(sends[0].params.items()))
            return (f"would have sent {sends[0].kind} to each of {len(sends)} hosts at once "
                    f"({named([str(s.host) for s in sends])})" + (f" ({args})" if args else ""))
        case Send(kind, hosts, params, host):
            args = " ".join(f"{k}={v}" for k, v in sorted(params.items()))
            to = f"to {host}" if host is not None else f"to every host ({named(hosts)})"
            return f"would have sent {kind} {to}" + (f" ({args})" if args else "")
        case _:
            return None


def observe(inc: Incident, step: IncidentStep, act: Act,
            observed: frozenset[str]) -> Outcome | None:
    """``step`` is only recorded when its kind is observed (:func:`.engine.observing`) and
    ``act`` would change something (a save, a rollback, a command, an isolation): the
    outcome the shell records instead of carrying it out. None: carry it out.

    Restarts and holds first look at the job as they would when acting (the launcher may
    have restarted it already: then acting would have skipped it too), so the record
    compares like with like; the command they end in is what is observed. Nothing
    restarted the job, so resolution does not wait for a later attempt."""
    if step.action not in observed:
        return None
    text = would(act)
    if text is None:
        return None
    if isinstance(act, Send) and act.kind == "restart":
        inc.restarted_attempt = None
    return Outcome("observed", text)


# -- restarts and holds ------------------------------------------------------------------

def _in_place(inc: Incident, view: JobView) -> bool:
    """The agent replaced ``inc``'s rank in place (its report came): that is the
    launcher's restart, and the survivors' attempt does not rise to say so."""
    recovery.apply(inc, view.recoveries)
    return recovery.recovered_in_place(inc)


def _restarted(inc: Incident, view: JobView) -> bool:
    return launcher_restarted(inc, view) or _in_place(inc, view)


@dataclass(frozen=True)
class Wait:
    """Read the job's view again every ``every`` seconds until ``until`` holds, for at most
    ``seconds``."""

    seconds: float
    every: float
    until: Callable[[Incident, JobView], bool]


def restart_waits(inc: Incident, step: IncidentStep, policy: Policy) -> list[Wait]:
    """What a restart of the group waits for, in order: after an isolation, the isolated
    agent's word that the survivors re-form in place without it; after a dead worker, the
    launcher's own restart (torchrun restarts the group by itself). None for a culprit."""
    if "rank" in step.params:
        return []
    waits = []
    if recovery.isolated(inc):
        waits.append(Wait(recovery.RESIZE_WAIT_S, 0.5, _in_place))
    if waits_for_launcher(inc):
        waits.append(Wait(policy.launcher_grace_s, 1.0, _restarted))
    return waits


def restart(inc: Incident, step: IncidentStep, view: JobView) -> Outcome | Send:
    """The restart ``step`` as the job is now (its waits over): skipped when the group
    re-formed in place, the launcher restarted it, or nobody is left to restart; else the
    command, and the attempt it ends is the incident's ``restarted_attempt``.

    A culprit's restart (``rank`` in its params) goes to its host's agent, which restarts
    it in place when its group can take it and the group otherwise; each one counts."""
    if "rank" in step.params:
        skipped = moot(inc, view, "restart")
        if skipped is not None:
            return skipped
        host = str(step.params["host"])
        inc.restarted_attempt = view.attempt
        return _send(step, "restart", [host], {"rank": step.params["rank"],
                                               "fallback": step.params.get("fallback", "group")},
                     host=host, counts=True)
    if _in_place(inc, view):
        return Outcome("skipped", recovery.skip_detail(inc))
    if launcher_restarted(inc, view):
        skip_restart(inc, step, view)
        return Outcome(step.status, step.detail)
    skipped = moot(inc, view, "restart")
    if skipped is not None:
        return skipped
    inc.restarted_attempt = view.attempt
    return _send(step, "restart", sorted(view.hosts), counts=True, attempt=view.generation)


def hold(inc: Incident, step: IncidentStep, view: JobView) -> Outcome | Send:
    """Stop every agent of the job (skipped when every launcher has exited already)."""
    skipped = moot(inc, view, "hold")
    return skipped if skipped is not None else _send(step, "hold", sorted(view.hosts))


# -- what came back ----------------------------------------------------------------------

def sent(step: IncidentStep, command_id: str) -> None:
    """``step`` sent command ``command_id`` (saved before it goes out: a successor leader
    must know it was sent)."""
    step.command_ids.append(command_id)
    step.status = "sent"


def judge(step: IncidentStep, acks: Sequence[CommandAck], send: Send) -> bool:
    """Record on ``step`` what the acks of one send mean; True: send it again as a retry."""
    verdict = ack_verdict(acks, send.hosts, send.kind, step.detail)
    step.status, step.detail = verdict.status, verdict.detail
    return verdict.retry


def fenced(step: IncidentStep, hosts: Sequence[str], acks: Sequence[CommandAck],
           domain: str = "") -> None:
    """A :class:`Fence` is done once its hosts are blocklisted: the agents of lost hosts
    cannot answer, so their acks (any that came) are only noted."""
    answered = sorted({a.responder.removeprefix("host-") for a in acks} & set(hosts))
    where = f" of {domain}" if domain else ""
    step.status = "done"
    step.detail = (f"blocklisted {len(hosts)} hosts{where}: {', '.join(hosts)}; their agents "
                   f"told ({len(answered)} answered)")


def note_hook(step: IncidentStep, run: HookRun) -> str:
    """Keep the isolate hook's outcome on the step; the line to log. A failed hook does not
    fail the isolation (the blocklist and the agent already keep the host out of
    trainguard jobs): the shell logs it as an error for the operator."""
    step.hook = run
    line = hooks.summary(run)
    step.detail = f"{step.detail}; {line}" if step.detail else line
    return line


# -- rollback in place -------------------------------------------------------------------

@dataclass(frozen=True)
class Reload:
    """Every rank loads checkpoint ``params`` in-process at one agreed step (``reload``,
    collective, to ``cmd.all``); every rank answers."""

    params: dict[str, Any]
    responders: list[str]


def reload_point(step: IncidentStep, reply: RollbackReply | None) -> tuple[int, str] | None:
    """Where a done rollback put the resume pointer (step, path), to reload in place; with
    no checkpoint on disk to go back to, :data:`MEMORY_ONLY` (the ranks' memory alone)."""
    if step.status != "done" or reply is None:
        return None
    if reply.step is None:
        return (MEMORY_ONLY, "") if reply.memory_step is not None else None
    return reply.step, reply.point.path if reply.point is not None else ""


def reload(step: IncidentStep, view: JobView, at: int, path: str) -> Reload | None:
    """The ``reload`` of checkpoint ``at``, or of the ranks' newest memory snapshot below
    the rollback's ``below_step`` where every rank holds one at least as new; None (noted on
    the step) when the job's world size is unknown: the plan's restart rolls back instead."""
    if view.world_size <= 0:
        step.detail += "; no reload in place: the job's world size is unknown"
        return None
    params: dict[str, Any] = {"step": at, "path": path}
    if "below_step" in step.params:
        params["below"] = int(step.params["below_step"])
    return Reload(params, recovery.reload_responders(view.world_size))


def reloaded(step: IncidentStep, acks: Sequence[CommandAck], world_size: int) -> None:
    """All ranks done: no process restarts (the plan's restart is skipped); otherwise the
    restart of today runs, from the pointer as it stands. What the job saved of its bad
    state meanwhile is suspect by its state_since, so no second rollback: one after
    another incident restarted the group would mark the fresh group's saves suspect."""
    done, detail = recovery.reload_verdict(acks, world_size)
    step.params[recovery.RELOADED] = done
    step.detail = f"{step.detail}; {detail}"
