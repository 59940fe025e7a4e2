"""Acknowledgements of the remediator's commands, collected as they arrive.

Acks come on core NATS (``tg.<job>.ack.remediator``) and may arrive before anyone waits
for them, so they are kept by command id until the sender collects them. Acks nobody
collects (a standby hears the leader's; a late one comes after its wait ended) are kept
for at most ``keep_s`` seconds and ``max_commands`` command ids, oldest dropped first: a
standby that stands by for weeks holds no more than that.

A command to ``cmd.all`` is answered by every agent of the job (2,048 at 16k ranks), so
each ack costs the same whatever came before it: a waiting sender keeps the set of hosts
not heard from yet and each ack takes its responder out of it (O(1)); the sender wakes
once, when that set is empty, not once per ack to scan every ack again (O(n^2) in all).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from trainguard.contract.schemas import CommandAck

from .engine import answered_by

KEEP_S = 600.0
"""Uncollected acks older than this are dropped (every wait is far shorter)."""
MAX_COMMANDS = 10_000


@dataclass
class _Wait:
    """A sender waiting for the acks of one command."""

    awaited: set[str]
    """Hosts not heard from yet; none named: any answer will do (:attr:`anyone`)."""
    anyone: bool
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def heard(self, ack: CommandAck) -> None:
        self.awaited.discard(answered_by(ack))
        if not self.awaited:  # with ``anyone``: this first answer is enough
            self.done.set()


class AckBox:
    def __init__(self, *, keep_s: float = KEEP_S, max_commands: int = MAX_COMMANDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._acks: collections.OrderedDict[str, list[CommandAck]] = collections.OrderedDict()
        self._first: dict[str, float] = {}
        self._waits: dict[str, _Wait] = {}
        self.keep_s, self.max_commands, self._clock = keep_s, max_commands, clock

    def add(self, ack: CommandAck) -> None:
        ident = ack.command_id
        new = ident not in self._acks
        if new:
            self._first[ident] = self._clock()
        self._acks.setdefault(ident, []).append(ack)
        if new:
            self._prune()
        wait = self._waits.get(ident)
        if wait is not None:
            wait.heard(ack)

    def __len__(self) -> int:
        """Command ids with acks kept."""
        return len(self._acks)

    def _prune(self) -> None:
        """Drop the oldest uncollected acks past ``keep_s`` or ``max_commands`` (never those
        of a command someone waits for). Runs once per new command id, not per ack, and
        walks only the ids it drops (oldest first: it stops at the first young one)."""
        now = self._clock()
        excess = len(self._acks) - self.max_commands
        drop: list[str] = []
        for ident in self._acks:
            if len(drop) >= excess and now - self._first[ident] <= self.keep_s:
                break  # oldest first: the rest are younger
            if ident not in self._waits:
                drop.append(ident)
        for ident in drop:
            del self._acks[ident]
            del self._first[ident]

    async def collect(self, ident: str, hosts: Collection[str],
                      timeout: float) -> list[CommandAck]:
        """The acks of command ``ident``, once every host in ``hosts`` answered (any answer
        when none is named) or after ``timeout`` seconds (what came by then)."""
        early = self._acks.get(ident, [])
        wait = _Wait(set(hosts), not hosts)
        if early:
            for ack in early:
                wait.heard(ack)
        self._waits[ident] = wait
        try:
            if not wait.done.is_set() and timeout > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wait.done.wait(), timeout)
        finally:
            self._waits.pop(ident, None)
        self._first.pop(ident, None)
        return self._acks.pop(ident, [])
