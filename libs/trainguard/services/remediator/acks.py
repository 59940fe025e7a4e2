"""Acknowledgements of the remediator's commands, collected as they arrive.

Acks come on core NATS (``tg.<job>.ack.remediator``) and may arrive before anyone waits
for them, so they are kept by command id until the sender collects them. Acks nobody
collects (a standby hears the leader's; a late one comes after its wait ended) are kept
for at most ``keep_s`` seconds and ``max_commands`` command ids, oldest dropped first: a
standby that stands by for weeks holds no more than that.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable, Collection

from trainguard.contract.schemas import CommandAck

from .engine import acks_complete

KEEP_S = 600.0
"""Uncollected acks older than this are dropped (every wait is far shorter)."""
MAX_COMMANDS = 10_000


class AckBox:
    def __init__(self, *, keep_s: float = KEEP_S, max_commands: int = MAX_COMMANDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._acks: collections.OrderedDict[str, list[CommandAck]] = collections.OrderedDict()
        self._first: dict[str, float] = {}
        self._events: dict[str, asyncio.Event] = {}
        self.keep_s, self.max_commands, self._clock = keep_s, max_commands, clock

    def add(self, ack: CommandAck) -> None:
        ident = ack.command_id
        if ident not in self._acks:
            self._first[ident] = self._clock()
        self._acks.setdefault(ident, []).append(ack)
        self._prune()
        event = self._events.get(ident)
        if event is not None:
            event.set()

    def __len__(self) -> int:
        """Command ids with acks kept."""
        return len(self._acks)

    def _prune(self) -> None:
        """Drop the oldest uncollected acks past ``keep_s`` or ``max_commands`` (never those
        of a command someone waits for)."""
        now = self._clock()
        for ident in list(self._acks):
            over = len(self._acks) > self.max_commands
            if not over and now - self._first[ident] <= self.keep_s:
                break  # oldest first: the rest are younger
            if ident not in self._events:
                del self._acks[ident]
                del self._first[ident]

    async def collect(self, ident: str, hosts: Collection[str],
                      timeout: float) -> list[CommandAck]:
        """The acks of command ``ident``, once every host in ``hosts`` answered or after
        ``timeout`` seconds (what came by then)."""
        deadline = time.monotonic() + timeout
        event = self._events[ident] = asyncio.Event()
        try:
            while not acks_complete(self._acks.get(ident, []), hosts):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                event.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), remaining)
        finally:
            self._events.pop(ident, None)
        self._first.pop(ident, None)
        return self._acks.pop(ident, [])
