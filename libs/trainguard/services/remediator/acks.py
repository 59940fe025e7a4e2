"""Acknowledgements of the remediator's commands, collected as they arrive.

Acks come on core NATS (``tg.<job>.ack.remediator``) and may arrive before anyone waits
for them, so they are kept by command id until the sender collects them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Collection

from trainguard.contract.schemas import CommandAck

from .engine import acks_complete


class AckBox:
    def __init__(self) -> None:
        self._acks: dict[str, list[CommandAck]] = {}
        self._events: dict[str, asyncio.Event] = {}

    def add(self, ack: CommandAck) -> None:
        self._acks.setdefault(ack.command_id, []).append(ack)
        event = self._events.get(ack.command_id)
        if event is not None:
            event.set()

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
        return self._acks.pop(ident, [])
