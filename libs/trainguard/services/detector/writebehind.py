"""The detector's Redis writes, off the detection path: written when Redis answers, kept
and retried when it does not.

Detection never waits for Redis. Each Redis command retries for seconds before it fails,
so a detector that awaited its writes before publishing held a hang back for as long as
Redis was away. Now anomaly changes go to :class:`FieldWrites` (one pending value per hash
field, the newest winning, so an outage costs memory per open anomaly, not per change),
and :class:`WriteBehind` writes them in one ``MULTI`` when Redis answers. The service waits
a moment (``redis_wait``) for a change to be stored before publishing it, so normally a
restarted detector neither alerts twice nor loses an unsent alert; when Redis is slow or
down it publishes anyway (an alert is worth more than its dedupe record) and the record
follows when Redis is back. :class:`Outage` says so in the log once per outage, not once a
tick.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import redis.asyncio as aioredis

from trainguard.runtime.lease import LeaseHolder

log = logging.getLogger("trainguard.detector")

Field = tuple[str, str]
"""(hash key, field)."""


class FieldWrites:
    """Pending hash writes: per field its newest value, or None to delete it (pure)."""

    def __init__(self, limit: int = 100_000) -> None:
        self.limit = limit
        self.dropped = 0
        """Writes given up because more than ``limit`` fields were pending."""
        self._fields: dict[Field, str | None] = {}

    def __len__(self) -> int:
        return len(self._fields)

    def set(self, key: str, field: str, value: str) -> None:
        self._put((key, field), value)

    def delete(self, key: str, field: str) -> None:
        self._put((key, field), None)

    def _put(self, where: Field, value: str | None) -> None:
        self._fields.pop(where, None)  # re-inserted last: the order is the order of changes
        self._fields[where] = value
        while len(self._fields) > self.limit:
            del self._fields[next(iter(self._fields))]
            self.dropped += 1

    def of_key(self, key: str) -> dict[str, str | None]:
        """The pending values of ``key``'s fields (None: to delete), leaving them pending."""
        return {field: value for (k, field), value in self._fields.items() if k == key}

    def keys(self) -> frozenset[Field]:
        return frozenset(self._fields)

    def take(self) -> dict[Field, str | None]:
        """Everything pending, leaving nothing (the caller writes it or gives it back)."""
        out, self._fields = self._fields, {}
        return out

    def give_back(self, failed: dict[Field, str | None]) -> None:
        """A write failed: pending again, except where a newer value came meanwhile."""
        newer, self._fields = self._fields, dict(failed)
        for where, value in newer.items():
            self._put(where, value)


class Outage:
    """Logs a dependency's outage once when it begins and once when it ends."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.since: float | None = None

    @property
    def down(self) -> bool:
        return self.since is not None

    def failed(self, doing: str, exc: BaseException) -> None:
        if self.since is None:
            self.since = time.monotonic()
            log.warning("%s unreachable (%s: %r): detection goes on; writes are kept and "
                        "retried", self.what, doing, exc)

    def answered(self) -> None:
        if self.since is not None:
            log.info("%s answers again after %.1fs", self.what, time.monotonic() - self.since)
            self.since = None


class WriteBehind:
    """Writes :class:`FieldWrites` to Redis, one write at a time, in the background."""

    def __init__(self, redis: aioredis.Redis, outage: Outage, *,
                 holder: Callable[[], LeaseHolder | None] = lambda: None) -> None:
        self.redis = redis
        self.outage = outage
        self.holder = holder
        """The leases this process holds now (None: none yet); it fences the writes."""
        self.fences: dict[str, str] = {}
        """Hash key -> the lease its writes need: a job's records are written only while
        its lease is ours, so a detector that lost the job overwrites nothing of its new
        owner's; where nobody holds it they stay pending (we may take the job back)."""
        self.fenced_out = 0
        """Field writes dropped because another detector held the lease."""
        self._unowned: set[Field] = set()
        """Writes the last attempt gave back because nobody held their lease: retried at
        the next kick, not waited for."""
        self.pending = FieldWrites()
        self._task: asyncio.Task[None] | None = None
        self._started = 0.0
        self._writing: dict[Field, str | None] = {}
        """The batch the write under way carries (taken from ``pending``)."""

    def unwritten(self, key: str) -> dict[str, str | None]:
        """``key``'s field values not known to be stored yet: the write under way's, then
        the newer pending ones (None: to delete)."""
        out = {field: value for (k, field), value in self._writing.items() if k == key}
        out.update(self.pending.of_key(key))
        return out

    def kick(self) -> asyncio.Task[None] | None:
        """Start writing what is pending, unless a write is under way; returns that write."""
        if self._task is None and len(self.pending):
            self._started = time.monotonic()
            self._task = asyncio.create_task(self._write(), name="detector:write-behind")
        return self._task

    async def settle(self, wait: float) -> bool:
        """Write what is pending, waiting at most ``wait`` seconds (none while Redis is
        down or a write is already slow); True if everything pending is stored."""
        deadline = time.monotonic() + wait
        tried = False
        while len(self.pending) or self._task is not None:
            if tried and self._task is None and self.pending.keys() <= self._unowned:
                return False  # only writes no lease lets us make: not now
            if self.outage.down or (self._task is not None
                                    and time.monotonic() - self._started > wait):
                self.kick()
                return False
            left = deadline - time.monotonic()
            task = self.kick()
            tried = True
            if task is None or left <= 0:
                return False
            await asyncio.wait({task}, timeout=left)
        return True

    async def _write(self) -> None:
        batch = self._writing = self.pending.take()
        try:
            fenced, free = self._split(batch)
            if free:
                pipe = self.redis.pipeline(transaction=True)
                for (key, field), value in free.items():
                    if value is None:
                        pipe.hdel(key, field)
                    else:
                        pipe.hset(key, field, value)
                await pipe.execute()
            if fenced:
                self._refused(batch, fenced, await self._fenced(fenced))
        except Exception as exc:
            self.pending.give_back(batch)
            self.outage.failed("storing anomaly state", exc)
        else:
            self.outage.answered()
        finally:
            self._task = None
            self._writing = {}

    def _split(self, batch: dict[Field, str | None]
               ) -> tuple[dict[str, dict[str, str | None]], dict[Field, str | None]]:
        """The writes by hash key that a lease fences, and the others."""
        fenced: dict[str, dict[str, str | None]] = {}
        free: dict[Field, str | None] = {}
        for (key, field), value in batch.items():
            if key in self.fences:
                fenced.setdefault(key, {})[field] = value
            else:
                free[(key, field)] = value
        return fenced, free

    async def _fenced(self, fenced: dict[str, dict[str, str | None]]) -> list[str | None]:
        holder = self.holder()
        if holder is None:
            return [""] * len(fenced)  # no leases yet: nothing of a job is ours to write
        return await holder.hwrite((self.fences[k], k, v) for k, v in fenced.items())

    def _refused(self, batch: dict[Field, str | None],
                 fenced: dict[str, dict[str, str | None]], owners: list[str | None]) -> None:
        """Writes whose lease was not ours: pending again where nobody holds it, dropped
        where another detector does."""
        back: dict[Field, str | None] = {}
        for (key, fields), owner in zip(fenced.items(), owners, strict=True):
            if owner is None:
                continue
            if owner == "":
                back.update({(key, f): v for f, v in fields.items()})
                continue
            self.fenced_out += len(fields)
            log.warning("not writing %d anomaly record change(s) of %s: its lease is %s's "
                        "now", len(fields), key, owner)
        self._unowned = set(back)
        if back:
            self.pending.give_back({w: v for w, v in batch.items() if w in back})

    async def close(self, wait: float) -> None:
        """Store what is left if Redis lets us within ``wait``; then stop trying."""
        with contextlib.suppress(Exception):
            await self.settle(wait)
        task = self._task
        if task is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
