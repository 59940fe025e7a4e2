"""Lanes: the messages of one key in order, those of different keys at once.

A durable consumer's loop settles what it fetched one message after another. Where the
messages of one job must be handled in order but those of different jobs need not be (a
detector's worker exits: each handler waits for Redis and the bus), that makes every job
wait behind the busiest: a crash storm of a few hundred exits in one job held another
job's single crash until all of them were handled. :class:`Lanes` gives each key (the
job) its own task, started with the key's first message and ended with its last; the
loop hands messages over and fetches on, bounded by ``limit`` messages in hand at once:
:data:`LANES_BATCHES` fetches' worth (a message waits in its lane unacknowledged, and one
that waited past the consumer's ``ack_wait`` would be delivered again), at most the
consumer's ``max_ack_pending`` (the server sends no more).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")

LANES_BATCHES = 4
"""A consumer with lanes holds at most this many fetch batches of messages in hand."""


class Lanes(Generic[T]):
    """Hands items to ``work``: those of one key in the order given, the keys concurrently.

    Args:
        work: handles one item; expected not to raise (an exception is the caller's bug and
            is re-raised by :meth:`join`, after the lane's other items).
        key: the lane of an item.
        limit: items given and not yet handled at most; :meth:`put` waits for room.
    """

    def __init__(self, work: Callable[[T], Awaitable[None]], key: Callable[[T], str],
                 limit: int) -> None:
        self._work = work
        self._key = key
        self._room = asyncio.Semaphore(max(1, limit))
        self._queues: dict[str, collections.deque[T]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def busy(self) -> int:
        """Lanes with work in hand."""
        return len(self._queues)

    async def put(self, item: T) -> None:
        """Queue ``item`` on its lane (waiting while ``limit`` items are in hand)."""
        await self._room.acquire()
        key = self._key(item)
        queue = self._queues.get(key)
        if queue is not None:
            queue.append(item)
            return
        self._queues[key] = collections.deque([item])
        task = asyncio.create_task(self._run(key), name=f"lane:{key}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, key: str) -> None:
        queue = self._queues[key]
        try:
            while queue:
                try:
                    await self._work(queue[0])
                finally:
                    queue.popleft()
                    self._room.release()
        finally:
            # No await between the last popleft and here: a put() sees either this lane
            # (and is handled by the loop above) or none (and starts a new one).
            if self._queues.get(key) is queue:
                del self._queues[key]
                for _ in queue:  # an exception left items unhandled: give their room back
                    self._room.release()
                queue.clear()

    async def join(self) -> None:
        """Wait until every item given so far is handled."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks))

    def cancel(self) -> None:
        for task in list(self._tasks):
            task.cancel()
