"""Feeding the board from the bus: telemetry by core subscription, events from history.

Heartbeats, step reports and the agents' node heartbeats are core NATS (what the detector
hears too: the on-call role may subscribe to them); incidents and checkpoints come from the
event stream, read from the start of its history and then followed
(:func:`trainguard.runtime.eventlog.read`), so a dashboard opened late still shows what happened.
A message that does not decode is counted and skipped: the dashboard reads, it never
dead-letters (that is the services' job).
"""

from __future__ import annotations

import asyncio
import contextlib

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from trainguard.contract.binding import check_bound
from trainguard.contract.codec import decode_telemetry
from trainguard.contract.errors import DecodeError
from trainguard.contract.subjects import Subjects
from trainguard.core.connection import flush
from trainguard.runtime import eventlog
from trainguard.runtime.logs import get_logger

from .board import Board

log = get_logger("trainguard.dashboard")


class Feed:
    def __init__(self, nc: NATS, board: Board, prefix: str, job: str | None = None) -> None:
        self.nc, self.board, self.prefix = nc, board, prefix
        self.subjects = Subjects(prefix)
        self.job = job or "*"
        self.undecodable = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()

    async def start(self) -> None:
        s = Subjects(self.prefix)
        for kind in ("hb", "step", "node"):
            await self.nc.subscribe(s.pattern(kind, job=self.job), cb=self._telemetry)
        await flush(self.nc)  # the server knows the subscriptions once this returns
        self._tasks.append(asyncio.create_task(self._events(), name="dashboard:events"))

    async def stop(self) -> None:
        self._stop.set()  # the events reader ends within a second (eventlog.read: why)
        _, late = await asyncio.wait(self._tasks, timeout=5.0) if self._tasks else ((), ())
        for t in late:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _telemetry(self, msg: Msg) -> None:
        try:
            body = decode_telemetry(msg.data)
            check_bound(self.subjects, msg.subject, body)  # not in another rank's name
        except DecodeError:
            self.undecodable += 1
            return
        self.board.telemetry(body)

    async def _events(self) -> None:
        subject = Subjects(self.prefix).pattern("event", job=self.job, tail=">")
        while not self._stop.is_set():  # the stream may not exist yet: retry
            try:
                async for e in eventlog.read(self.nc.jetstream(), self.prefix, subject,
                                             follow=True, stop=self._stop):
                    if e.event is None:
                        self.undecodable += 1
                    else:
                        self.board.event(e.event)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("reading events failed (%r); retrying", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), 2.0)
