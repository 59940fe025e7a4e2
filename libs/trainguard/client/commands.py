"""Commands for a rank: intake on the transport thread, execution at safe points.

A command never runs on the background thread in the middle of a step. The transport
thread only decodes, filters and queues; the training thread runs commands when it enters
or leaves ``guard.step`` (the safe points):

* no ``at_step``: at the next safe point;
* ``at_step = S``: right after step S completes on this rank, which is the same place on
  every rank; a rank that already passed S acknowledges ``too_late`` and the sender
  retries with a later step;
* collective kinds (``save_now``, ``set_interval``, ``reload``) without ``at_step`` but
  with a ``seq``: at the next agreement boundary, after the ranks agree through an
  all-reduce (MAX) of the highest sequence each has received; a rank that has not received
  the agreed command yet waits for it up to ``collective_timeout``. Sequences below the
  lowest one any rank holds are skipped: sent before the group's processes listened (a
  group restarted since), no rank will ever get them.

When the group agrees and what one agreement settles (the boundaries, about every
``sync_period`` seconds of steps; the newest group generation, at which a group that took a
host back in place re-forms) is :mod:`trainguard.recovery.agreement`'s; running what was
agreed is the desk's.

Every command is acknowledged once (done, failed with the reason, too_late, unknown_kind,
refused for a stale epoch); a redelivered id, or a retry of a command already run, is not
run again. Those admission rules are :class:`trainguard.core.receiver.Receiver`'s, shared
with the node agent; what is a rank's own (scheduling at safe points) is here.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainguard.contract.codec import decode_as
from trainguard.contract.envelope import H_TRACEPARENT, H_TYPE, normalize_headers
from trainguard.contract.errors import DecodeError, DrillCrash, InvalidToken
from trainguard.contract.schemas import COLLECTIVE_KINDS, RANK_KINDS, AckOutcome, Command
from trainguard.contract.subjects import Subjects
from trainguard.contract.targets import for_agent
from trainguard.core import tracing
from trainguard.core.identity import Identity
from trainguard.core.rankstate import RankState
from trainguard.core.receiver import Answer, Drop, Receiver
from trainguard.recovery.agreement import NONE_HELD, AgreeFn, Cadence, agree, find_agreement
from trainguard.recovery.handle import Handler

from .transport import Transport

if TYPE_CHECKING:
    from nats.aio.msg import Msg

log = logging.getLogger("trainguard.client")

def _for_ranks(kind: str) -> bool:
    """Every kind that is not the agent's: a trainer's own kinds (``guard.on``) included."""
    return not for_agent(kind)


@dataclass
class Queued:
    command: Command
    traceparent: str | None
    received_at: float


class CommandDesk:
    """A rank's commands: received on the transport thread, run at the training thread's
    safe points.

    Args:
        identity: the rank (its ``cmd.rank.<r>`` subject, ``responder``, world size).
        subjects, transport: where commands come from and acks go.
        sync_every: the most steps between collective-command agreements.
        sync_period: the seconds between agreements the ranks aim at (at least one step).
        collective_timeout: how long a rank waits for an agreed command it has not got yet.
        clock: where step times are read (monotonic seconds).
        find: builds the agreement for a world size, at the same step on every rank
            (default :func:`find_agreement`: a torch.distributed side group).
        state: the rank's state, where the agreement shows as a collective wait.
    """

    def __init__(self, identity: Identity, subjects: Subjects, transport: Transport, *,
                 sync_every: int = 10, sync_period: float = 0.25,
                 collective_timeout: float = 30.0,
                 clock: Callable[[], float] = time.monotonic,
                 find: Callable[[int], AgreeFn | None] | None = None,
                 state: RankState | None = None) -> None:
        self.identity = identity
        self.subjects = subjects
        self.transport = transport
        self.cadence = Cadence(sync_every, sync_period, clock)
        """When the group agrees next (:mod:`trainguard.recovery.agreement`)."""
        self._find = find or find_agreement
        self._state = state or RankState()
        self.collective_timeout = collective_timeout
        self.receiver = Receiver("rank", str(identity.rank), _for_ranks)
        self.handlers: dict[str, Handler] = {}
        self.inbox: collections.deque[Queued] = collections.deque(maxlen=10_000)
        self.agreement: AgreeFn | None = None
        self._agreement_checked = False
        self._regrouped = False
        """The group re-formed: the agreement is built again at the next completed step."""
        self._at_step: list[Queued] = []
        self._collective: dict[int, Queued] = {}
        self._highest_seq = 0
        self._agreed_seq = 0
        self._last_completed: int | None = None
        self.executed: list[str] = []
        """Ids of commands run, in order (for tests and ``stats``)."""
        self._generation: Callable[[], int] = lambda: 0
        self._generation_rose: Callable[[int], None] = lambda _: None
        self._absorbs: Callable[[int, Exception], bool] = lambda step, error: False

    def absorb_failures(self, absorbs: Callable[[int, Exception], bool]) -> None:
        """``absorbs(step, error)`` is asked when the agreement after ``step`` fails: True
        when the loop recovers from it in place (a lost peer). The held commands then wait
        for the re-formed group, which hands them on; run locally instead, they would let
        this rank go on into the next collective and wait there for peers that are
        re-forming without it."""
        self._absorbs = absorbs

    def watch_generation(self, newest: Callable[[], int],
                         rose: Callable[[int], None]) -> None:
        """Agree on ``newest()`` (the newest group generation this rank knows of) at every
        boundary too; ``rose(g)`` gets the agreed one, the same on every rank."""
        self._generation, self._generation_rose = newest, rose

    def listen(self) -> None:
        """Subscribe to ``cmd.all`` and ``cmd.rank.<own>`` (core NATS: no server state)."""
        job, rank = self.identity.job, self.identity.rank
        self.transport.subscribe(self.subjects.cmd_all(job), self.on_message)
        self.transport.subscribe(self.subjects.cmd_rank(job, rank), self.on_message)

    def renumber(self, identity: Identity, *, subscribe: bool) -> None:
        """The rank's number or world size changed in an in-place re-form: commands for
        the new number concern it (``subscribe``: listen on its subject too; the old
        subject's commands are another rank's now and no longer concern this one)."""
        self.identity = identity
        self.receiver.rename(str(identity.rank))
        if subscribe:
            self.transport.subscribe(self.subjects.cmd_rank(identity.job, identity.rank),
                                     self.on_message)

    @property
    def has_work(self) -> bool:
        """Commands arrived or waiting for their ``at_step``: the next safe point has work."""
        return bool(self.inbox or self._at_step)

    @property
    def last_completed(self) -> int | None:
        """The last step this rank finished (None before the first)."""
        return self._last_completed

    # -- transport thread ---------------------------------------------------------------
    def on_message(self, msg: Msg) -> None:
        """Decode and queue; everything else happens on the training thread."""
        headers = normalize_headers(msg.headers)
        try:
            cmd = decode_as(msg.data, headers.get(H_TYPE), Command)
        except DecodeError as exc:
            log.warning("ignoring malformed command on %s: %s", msg.subject, exc.reason)
            return
        if not self.receiver.concerns(cmd):
            return  # the agent's kind, or another rank's command
        self.inbox.append(Queued(cmd, headers.get(H_TRACEPARENT), time.time()))

    # -- training thread ----------------------------------------------------------------
    def safe_point(self, completed: int | None) -> None:
        """Run what is due. ``completed`` is the step this rank just finished, or None
        when entering a step."""
        if completed is not None and not self._agreement_checked \
                and (self.cadence.due(completed) or self._regrouped):
            # The first boundary, or the first step a re-formed group completes: every
            # rank gets here at the same step (new_group is a collective), and
            # torch.distributed is up by now if the trainer uses it. A re-formed group
            # agrees at once: its boundaries start again from the same step on every rank.
            if self._regrouped:
                self.cadence.restart_at(completed)
            self._agreement_checked, self._regrouped = True, False
            self.agreement = self._find(self.identity.world_size)
            if self.agreement is None:  # kept for an agreement there is none of
                for seq in sorted(self._collective):
                    self._execute(self._collective.pop(seq))
        inbox = self.inbox
        while inbox:
            self._admit(inbox.popleft(), completed)
        if self._at_step:
            self._run_at_step(completed)
        if completed is not None and self.agreement is not None \
                and self.cadence.due(completed):
            self._agree_and_run(completed)

    def _admit(self, q: Queued, completed: int | None) -> None:
        cmd = q.command
        verdict = self.receiver.admit(cmd)
        if isinstance(verdict, Drop):
            return
        if isinstance(verdict, Answer):
            self._ack(q, verdict.outcome, verdict.detail)
            return
        if cmd.kind not in RANK_KINDS and cmd.kind not in self.handlers:
            self._ack(q, "unknown_kind", f"ranks do not run {cmd.kind!r}")
            return
        if cmd.at_step is not None:
            self._at_step.append(q)
            return
        if cmd.kind in COLLECTIVE_KINDS and cmd.seq > 0 and (self.agreement is not None
                                                              or self._regrouped):
            if cmd.seq <= self._agreed_seq:
                # The group agreed on it (and ran it) before this rank got it: a rank that
                # joined since, or one that waited past collective_timeout. Kept, it would
                # never run and be handed on to every later replacement.
                log.info("command %s (seq %d) came after the group ran it; not run here",
                         cmd.id, cmd.seq)
                return
            self._collective[cmd.seq] = q
            self._highest_seq = max(self._highest_seq, cmd.seq)
            return
        self._execute(q)

    def _run_at_step(self, completed: int | None) -> None:
        last = self._last_completed
        if last is None:
            return  # no step finished yet: every at_step is still ahead
        keep: list[Queued] = []
        for q in sorted(self._at_step, key=lambda x: (x.command.at_step or 0, x.received_at)):
            at = q.command.at_step
            assert at is not None
            if at > last:
                keep.append(q)
            elif at == last and completed is not None:
                self._execute(q)
            else:
                self._ack(q, "too_late", f"at_step {at} already passed (step {last} done)")
        self._at_step = keep

    def note_completed(self, step: int, *, timed: bool = True) -> None:
        """``timed=False``: the group went on after ``step`` without running it here (a
        re-form, a rollback): the time since the last step is no step time."""
        self._last_completed = step
        self.cadence.step_done(timed=timed)

    @property
    def scheduled(self) -> list[Command]:
        """Collective commands received and not run yet: waiting for their ``at_step``, for
        an agreement, or not admitted yet."""
        held = [q.command for q in (*self._at_step, *self._collective.values(), *self.inbox)]
        return [c for c in held if c.kind in COLLECTIVE_KINDS]

    def adopt_scheduled(self, commands: list[Command]) -> None:
        """A replacement takes the collective commands its peers hold: sent before it
        came, it never received them, and they run on every rank at one step."""
        held = {c.id for c in self.scheduled}
        for cmd in commands:
            if cmd.id not in held:
                self.inbox.append(Queued(cmd, None, time.time()))

    @property
    def agreed_seq(self) -> int:
        return self._agreed_seq

    def adopt_agreed(self, seq: int) -> None:
        """A replacement rank starts where its peers' agreement is: it never received the
        commands they agreed on before it came, so it must not wait for them."""
        self._agreed_seq = max(self._agreed_seq, seq)
        self._highest_seq = max(self._highest_seq, seq)
        for old in [s for s in self._collective if s <= self._agreed_seq]:
            del self._collective[old]  # received early; the peers ran it before this came

    def regrouped(self) -> None:
        """The process group was re-formed: the agreement's side group went with the old
        one. Every rank (a replacement too) builds it again when it completes the step the
        group continues at, and keeps collective commands for it meanwhile: run on
        arrival, they would run at a different step on each rank (a ``set_interval`` on
        the survivors only, and the replacement's save would meet their all_reduce)."""
        self.agreement = None
        self._agreement_checked = False
        self._regrouped = True

    def _lowest_held(self) -> int:
        """The lowest sequence this rank holds and has not run; NONE_HELD if none."""
        return min((s for s in self._collective if s > self._agreed_seq), default=NONE_HELD)

    def _agree_and_run(self, completed: int) -> None:
        assert self.agreement is not None
        try:
            with self._state.collective():
                agreed, generation, interval, floor = agree(
                    self.agreement, highest_seq=self._highest_seq,
                    generation=self._generation(), interval=self.cadence.proposed_interval(),
                    lowest_held=self._lowest_held())
        except Exception as exc:
            if self._absorbs(completed, exc):
                log.warning("collective command agreement failed (%r): the group re-forms",
                            exc)
                return
            log.warning("collective command agreement failed (%r); running commands locally",
                        exc)
            self.agreement = None
            for seq in sorted(self._collective):
                self._execute(self._collective.pop(seq))
            return
        self.cadence.agreed(completed, interval)
        self._generation_rose(generation)
        if agreed <= self._agreed_seq:
            return
        # Below the lowest sequence any rank holds, no rank will ever get one: it was sent
        # before these processes listened (a group restarted after it). Waiting for it
        # would stall the group for collective_timeout.
        if floor > self._agreed_seq + 1:
            log.info("commands of seq %d..%d reached no rank of this group (sent before it "
                     "started): skipped", self._agreed_seq + 1, min(floor, agreed + 1) - 1)
        deadline = time.monotonic() + self.collective_timeout
        for seq in range(max(self._agreed_seq + 1, floor), agreed + 1):
            while seq not in self._collective and time.monotonic() < deadline:
                # Another rank has it; ours is in flight. Admit arrivals while waiting.
                while self.inbox:
                    self._admit(self.inbox.popleft(), None)
                if seq not in self._collective:
                    time.sleep(0.002)
            q = self._collective.pop(seq, None)
            if q is not None:
                self._execute(q)
        self._agreed_seq = agreed

    def _execute(self, q: Queued) -> None:
        cmd = q.command
        handler = self.handlers.get(cmd.kind)
        if handler is None:
            self._ack(q, "failed", f"no handler registered for {cmd.kind!r} on this rank")
            return
        ctx = tracing.extract({H_TRACEPARENT: q.traceparent} if q.traceparent else None)
        with tracing.tracer("trainguard.client").start_as_current_span(
            f"process {cmd.kind}", context=ctx,
            attributes={"trainguard.job": cmd.job, "trainguard.rank": self.identity.rank,
                        "trainguard.command": cmd.kind},
        ):
            try:
                detail = handler(cmd)
            except DrillCrash:
                self._ack(q, "done", "crashing as asked")
                raise
            except Exception as exc:
                self._ack(q, "failed", f"{type(exc).__name__}: {exc}")
                return
            self.executed.append(cmd.id)
            self._ack(q, "done", detail or "")

    def _ack(self, q: Queued, outcome: AckOutcome, detail: str) -> None:
        cmd = q.command
        ack = self.receiver.ack(cmd, outcome, detail)
        try:
            subject = self.subjects.ack(cmd.job, cmd.issuer)
        except InvalidToken:
            return
        headers: dict[str, str] = {}
        tracing.inject(headers)
        self.transport.publish_durable(subject, ack,
                                       traceparent=headers.get(H_TRACEPARENT) or q.traceparent)
