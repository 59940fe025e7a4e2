"""Every anomaly change, in order: stored, published, marked published.

A change is stored in ``Keys.dedupe("detector", job)`` (field = the book's key, value = the
anomaly) *before* it is published, and its rev is marked published (``pub:<key>``) after,
so a detector that restarts, or takes a job over, neither alerts twice for what is open
nor loses an alert it had not sent yet (:meth:`AnomalyOutbox.load`). Storing waits for
Redis at most ``redis_wait`` (:mod:`.writebehind`): while Redis is away changes are
published anyway and stored when it is back. A change whose publish fails stays first in
line, and the next flush tries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from prometheus_client import Counter

from trainguard.contract.schemas import Anomaly
from trainguard.runtime.lease import LeaseHolder
from trainguard.runtime.state import Keys, Progress, decode_progress

from .book import Transition, dump_anomaly, load_anomaly
from .leases import ROLE
from .writebehind import Outage, WriteBehind

log = logging.getLogger("trainguard.detector")

PUBLISHED = "pub:"
"""Prefix of the dedupe-hash fields holding the last published rev of an anomaly."""

@dataclasses.dataclass
class Reload:
    """A job's state as a new owner read it from Redis, and what reading it cost."""

    open: dict[str, Anomaly] = dataclasses.field(default_factory=dict)
    progress: Progress | None = None
    fields: int = 0
    """Values read: the dedupe hash's fields and the progress record."""
    bytes: int = 0
    seconds: float = 0.0
    """Reading and decoding, after our own pending writes settled."""


Publish = Callable[[Transition], Awaitable[None]]


def _text(value: str | bytes) -> str:
    """Redis replies as text (the shared client decodes; a raw one would not)."""
    return value.decode() if isinstance(value, bytes) else value


class AnomalyOutbox:
    """The detector's anomaly changes on their way to Redis and the bus.

    Args:
        redis: the shared client.
        keys: the deployment's key names.
        publish: sends one change to the bus (raises if it could not).
        wait: ``redis_wait``.
        outage: the detector's view of Redis.
        published: counter of published changes by kind and status.
    """

    def __init__(self, redis: aioredis.Redis, keys: Keys, publish: Publish, wait: float,
                 outage: Outage, published: Counter,
                 holder: Callable[[], LeaseHolder | None] = lambda: None) -> None:
        self.redis = redis
        self.keys = keys
        self.publish = publish
        self.wait = wait
        self.writes = WriteBehind(redis, outage, holder=holder)
        self.pending: list[Transition] = []
        self._published = published
        self._lock = asyncio.Lock()

    async def flush(self, changes: list[Transition]) -> None:
        """Store (briefly waiting for Redis), publish, mark published: ``changes`` and any
        left from before, in order."""
        async with self._lock:
            for t in changes:
                key = self.keys.dedupe(ROLE, t.job)
                self.writes.fences[key] = self.keys.lease(ROLE, t.job)
                self.writes.pending.set(key, t.key, dump_anomaly(t.anomaly))
            self.pending.extend(changes)
            if not self.pending:
                return
            await self.writes.settle(self.wait)
            sent = await self._publish_in_order(list(self.pending))
            del self.pending[:len(sent)]
            for t in sent:
                key = self.keys.dedupe(ROLE, t.job)
                if t.anomaly.status == "resolved":
                    self.writes.pending.delete(key, t.key)
                    self.writes.pending.delete(key, PUBLISHED + t.key)
                else:
                    self.writes.pending.set(key, PUBLISHED + t.key, str(t.anomaly.rev))
            self.writes.kick()

    async def _publish_in_order(self, batch: list[Transition]) -> list[Transition]:
        sent: list[Transition] = []
        for t in batch:
            started = time.monotonic()
            try:
                await self.publish(t)
            except Exception as exc:
                log.warning("publishing anomaly %s failed (%r); will retry", t.anomaly.id, exc)
                break
            sent.append(t)
            self._published.labels(t.anomaly.kind, t.anomaly.status).inc()
            if time.monotonic() - started > 1.0:
                log.warning("publishing anomaly %s took %.1fs", t.anomaly.id,
                            time.monotonic() - started)
            log.info("anomaly %s %s job=%s kind=%s ranks=%s rev=%d", t.anomaly.status,
                     t.anomaly.id, t.job, t.anomaly.kind, t.anomaly.ranks[:16], t.anomaly.rev)
        return sent

    async def load(self, job: str, settle: float) -> Reload:
        """What a new owner of ``job`` starts from: its open anomalies and last progress.

        Changes stored but not marked published are queued to be published again. Our own
        pending writes go first (up to ``settle`` seconds), so what is read is current; what
        is still pending then (Redis just back, not yet known to be) is laid over what was
        read: an anomaly opened during the outage, its job dropped when its lease lapsed,
        is still open when the job is taken back, and resolves.
        """
        await self.writes.settle(settle)
        started = time.monotonic()
        key = self.keys.dedupe(ROLE, job)
        pipe = self.redis.pipeline(transaction=False)  # one round trip for both
        pipe.hgetall(key)
        pipe.get(self.keys.progress(job))
        raw_stored, raw_progress = await pipe.execute()
        stored = {_text(k): _text(v) for k, v in raw_stored.items()}
        size = sum(len(k) + len(v) for k, v in stored.items()) + len(raw_progress or "")
        reload = Reload(fields=len(stored) + (raw_progress is not None), bytes=size)
        for field, value in self.writes.unwritten(key).items():
            if value is None:
                stored.pop(field, None)
            else:
                stored[field] = value
        for field, value in stored.items():
            if field.startswith(PUBLISHED):
                continue
            try:
                anomaly = load_anomaly(value)
            except ValueError as exc:
                log.warning("job %s: dropping unreadable stored anomaly %s: %s", job, field, exc)
                continue
            if anomaly.rev > int(stored.get(PUBLISHED + field, 0)):
                self.pending.append(Transition(job, field, anomaly))
            if anomaly.status == "open":
                reload.open[field] = anomaly
        if raw_progress:
            with contextlib.suppress(ValueError):
                reload.progress = decode_progress(raw_progress)
        reload.seconds = time.monotonic() - started
        return reload

    async def close(self, wait: float, changes: list[Transition]) -> None:
        """Publish and store ``changes`` and what is left, within about ``wait`` seconds."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.flush(changes), wait)
        await self.writes.close(wait)
