"""Which arriving commands a receiver runs, and the ack it sends: one rule for every receiver.

A rank's command desk (:mod:`trainguard.client.commands`) and a node's agent
(``services/agent/executor.py``) both receive at-least-once deliveries from several issuers
(remediator, coordinator, cli), each fencing its leaders with an ``epoch``. Both must:

* ignore what is not theirs: a kind the other receiver runs (both see ``cmd.all``), or a
  ``target`` that names another host or rank. Ignored, not refused: the receiver that is
  addressed answers, and a refusal from a bystander would end the issuer's wait with the
  wrong answer;
* run each command id once (a redelivery is dropped: it was acknowledged already), and
  answer a retry (``retry_of``) of a command already done with ``done`` without running it
  again. Both are remembered for the last ``memory`` commands only, so a receiver that runs
  for weeks stays small;
* refuse an issuer outside :data:`~trainguard.contract.schemas.ISSUERS`, an epoch below the
  highest seen from the same issuer (a deposed leader), and, where the caller knows the
  issuer's current epoch (the agent reads it from Redis, where only the leader raises it),
  an epoch above it: one forged message must not fence the real leader out.

:class:`Receiver` holds that state and no I/O; the caller runs the command and sends the
:class:`~trainguard.contract.schemas.CommandAck` that :meth:`Receiver.ack` builds. The verdict of
:meth:`Receiver.admit` is :class:`Run`, :class:`Answer` or :class:`Drop`.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from trainguard.contract.schemas import ISSUERS, AckOutcome, Command, CommandAck

Scope = Literal["host", "rank"]
EVERYONE = "all"
"""``Command.target`` of a broadcast (``cmd.all``); otherwise ``<scope>.<name>``, the subject
tail that :func:`trainguard.contract.targets.addressed` writes."""


@dataclass(frozen=True, slots=True)
class Run:
    """Admitted: run the command, then :meth:`Receiver.ack` how it ended."""


@dataclass(frozen=True, slots=True)
class Answer:
    """Answered without running: send ``Receiver.ack(cmd, outcome, detail)``."""

    outcome: AckOutcome
    detail: str


@dataclass(frozen=True, slots=True)
class Drop:
    """Not this receiver's, or acknowledged already: no run, no ack (``reason`` is for logs)."""

    reason: str


Admission = Run | Answer | Drop


@dataclass(frozen=True)
class Unreadable:
    """The issuer's current epoch could not be read (``why``): a command that would raise
    the epoch is refused, so the fence fails closed; commands at the known epoch run."""

    why: str
RUN = Run()


def clip(detail: str, limit: int) -> str:
    """``detail`` within ``limit`` characters, keeping both ends: the head names the error,
    the tail holds the latest lines (of a stack dump, say)."""
    if len(detail) <= limit:
        return detail
    head = limit // 4
    return f"{detail[:head]} … {detail[len(detail) - (limit - head - 3):]}"


class Receiver:
    """Admission and acks for one receiver: ``host-<h>`` (an agent) or ``rank-<r>``.

    Args:
        scope, name: who this is (``"host", "node-b"`` or ``"rank", "3"``): the target it
            answers besides ``all``, and its ack's ``responder``.
        owns: whether a kind is this receiver's to answer (the rest are dropped unseen).
        memory: how many command ids are remembered for dedupe and ``retry_of``.
        detail_limit: characters of an ack's ``detail``.
    """

    def __init__(self, scope: Scope, name: str, owns: Callable[[str], bool], *,
                 memory: int = 10_000, detail_limit: int = 2000) -> None:
        self.scope: Scope = scope
        self.name = name
        self.responder = f"{scope}-{name}"
        self.owns = owns
        self.memory = memory
        self.detail_limit = detail_limit
        self._outcomes: collections.OrderedDict[str, AckOutcome] = collections.OrderedDict()
        self._epochs: dict[str, int] = {}
        """Highest epoch per issuer: each issuer's leader has its own fencing token."""

    def rename(self, name: str) -> None:
        """This receiver answers as ``name`` from now on (a rank renumbered in place); what
        it ran and the epochs it saw stay remembered."""
        self.name = name
        self.responder = f"{self.scope}-{name}"

    def addressed(self, target: str) -> bool:
        """Whether ``target`` includes this receiver. A target in a form this version does
        not know counts as addressed: the subject it came on was this receiver's."""
        if target == EVERYONE:
            return True
        scope, _, name = target.partition(".")
        if scope not in ("host", "rank"):
            return True
        return scope == self.scope and name == self.name

    def concerns(self, cmd: Command) -> bool:
        """Kind and target are this receiver's. Reads no state: safe on any thread."""
        return self.owns(cmd.kind) and self.addressed(cmd.target)

    def admit(self, cmd: Command, ceiling: int | Unreadable | None = None) -> Admission:
        """The verdict on ``cmd``; an admitted epoch becomes the issuer's highest.

        ``ceiling``: the issuer's current epoch, where known; a higher one is forged.
        :class:`Unreadable`: it should be known and could not be read.
        """
        if not self.owns(cmd.kind):
            return Drop(f"{cmd.kind!r} is not run by a {self.scope}")
        if not self.addressed(cmd.target):
            return Drop(f"addressed to {cmd.target}, not {self.responder}")
        if cmd.id in self._outcomes:
            return Drop("redelivered: acknowledged already")
        if cmd.retry_of is not None and self._outcomes.get(cmd.retry_of) == "done":
            return Answer("done", f"already done as {cmd.retry_of}")
        if cmd.issuer not in ISSUERS:
            return Answer("refused", f"unknown issuer {cmd.issuer!r} (commands come from "
                                     f"{', '.join(sorted(ISSUERS))})")
        highest = self._epochs.get(cmd.issuer, 0)
        if cmd.epoch < highest:
            return Answer("refused", f"stale epoch {cmd.epoch} < {highest} of {cmd.issuer}")
        if isinstance(ceiling, Unreadable) and cmd.epoch > highest:
            return Answer("refused", f"epoch {cmd.epoch} would raise {cmd.issuer}'s above "
                                     f"{highest}, and its current epoch cannot be read "
                                     f"({ceiling.why}): refused until it can be")
        if isinstance(ceiling, int) and cmd.epoch > ceiling:
            return Answer("refused", f"epoch {cmd.epoch} is above {cmd.issuer}'s current "
                                     f"epoch {ceiling}: not issued by its leader")
        self._epochs[cmd.issuer] = cmd.epoch
        return RUN

    def highest_epoch(self, issuer: str) -> int:
        return self._epochs.get(issuer, 0)

    def raises_epoch(self, cmd: Command) -> bool:
        """Whether admitting ``cmd`` would raise its issuer's epoch (worth checking)."""
        return cmd.epoch > self._epochs.get(cmd.issuer, 0)

    def record(self, cmd: Command, outcome: AckOutcome) -> None:
        """Remember how ``cmd`` ended (its redeliveries are dropped, retries answered)."""
        outcomes = self._outcomes
        outcomes[cmd.id] = outcome
        outcomes.move_to_end(cmd.id)
        while len(outcomes) > self.memory:
            outcomes.popitem(last=False)

    def ack(self, cmd: Command, outcome: AckOutcome, detail: str = "") -> CommandAck:
        """Record the outcome and build the ack the issuer gets."""
        self.record(cmd, outcome)
        return CommandAck(command_id=cmd.id, job=cmd.job, responder=self.responder,
                          outcome=outcome, detail=clip(detail, self.detail_limit),
                          kind=cmd.kind, time=time.time())
