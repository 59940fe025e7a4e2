"""The detector service: a thin async shell around :class:`~.engine.Detector`.

It feeds the pure rules from the bus and writes what they find back out:

* telemetry (``hb``, ``step``, ``fp``, ``gpu``, ``node``) through per-job core
  subscriptions, taken when this instance wins the job's lease (:mod:`.leases`);
* durable consumers on the REPORTS stream: ``reg`` (``RankHello``/``NodeHello``: job
  discovery), ``exit`` (``WorkerExit``: crashes) and ``ckpt`` (slow checkpoints). A
  message of a job another instance owns is redelivered (``Retry``) until its owner
  takes it, so every replica can bind the same durable;
* timers: rules that only time reveals (every ``tick_interval``), ``progress:<job>`` to
  Redis (every ``progress_interval``, one pipeline), leases (every ``lease_interval``).

Anomaly changes are written to ``Keys.dedupe("detector", job)`` *before* they are
published and marked published after, so a detector that restarts, or takes a job over,
neither alerts twice for what is open nor loses an alert it had not sent yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import time
import uuid
from collections.abc import Sequence
from typing import Any

from prometheus_client import Counter, Gauge

from trainguard.config import Settings, load_settings
from trainguard.errors import Retry
from trainguard.schemas import (
    Anomaly,
    CheckpointReport,
    NodeHello,
    RankHello,
    TelemetryMessage,
    WorkerExit,
)
from trainguard.service import Consumer, Delivery, Runtime, Service
from trainguard.state import Keys, decode_progress, encode_progress
from trainguard.topology import ConsumerSpec

from .book import Transition, dump_anomaly, load_anomaly
from .engine import Detector
from .leases import ROLE, Leases, preferred
from .settings import DetectorSettings
from .thresholds import thresholds_of

log = logging.getLogger("trainguard.detector")

TELEMETRY_KINDS = ("hb", "step", "fp", "gpu", "node")
PUBLISHED = "pub:"
"""Prefix of the dedupe-hash fields holding the last published rev of an anomaly."""


def _text(value: str | bytes) -> str:
    """Redis replies as text (the shared client decodes; a raw one would not)."""
    return value.decode() if isinstance(value, bytes) else value


class DetectorService(Service[DetectorSettings]):
    """Finds hangs, crashes, stragglers, bad numerics and SDC; publishes ``Anomaly`` events."""

    name = "detector"
    settings_type = DetectorSettings

    def __init__(self, settings: Settings) -> None:
        if not isinstance(settings, DetectorSettings):
            settings = load_settings(DetectorSettings, env={},
                                     overrides=dataclasses.asdict(settings))
        super().__init__(settings)
        self.cfg: DetectorSettings = settings
        self.detector = Detector(thresholds_of(settings))
        self.keys = Keys(settings.prefix)
        self.instance = settings.instance_id or (
            f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
        self.owned: set[str] = set()
        self.subscribed: set[str] = set()
        self.retired: dict[str, float] = {}
        self._free_since: dict[str, float] = {}
        self._pending: list[Transition] = []
        self._flush_lock = asyncio.Lock()
        self._own_lock = asyncio.Lock()
        self._started = asyncio.Event()
        self._leases: Leases | None = None
        self._reconnects = 0
        self._published: Any = None

    @property
    def leases(self) -> Leases:
        assert self._leases is not None, "detector not started"
        return self._leases

    # -- wiring -------------------------------------------------------------------------
    def consumers(self) -> Sequence[Consumer]:
        s = self.settings.subjects
        return [
            Consumer(ConsumerSpec("reports", "detector-reg", (s.pattern("reg"),)),
                     self._on_reg, (RankHello, NodeHello)),
            Consumer(ConsumerSpec("reports", "detector-exit", (s.pattern("exit"),)),
                     self._on_exit, (WorkerExit,)),
            Consumer(ConsumerSpec("reports", "detector-ckpt", (s.pattern("ckpt"),),
                                  deliver_new=True),
                     self._on_ckpt, (CheckpointReport,)),
        ]

    async def start(self, rt: Runtime) -> None:
        registry = rt.metrics.registry
        self._published = Counter("trainguard_detector_anomalies",
                                  "Anomaly changes published, by kind and status",
                                  ["kind", "status"], registry=registry)
        Gauge("trainguard_detector_jobs", "Jobs this detector owns",
              registry=registry).set_function(lambda: len(self.owned))
        self._leases = Leases(rt.redis, self.keys, self.instance, self.cfg.lease_ttl,
                              self.settings.redis_key(ROLE, "instances"))
        self._reconnects = rt.bus.nc.stats["reconnects"]
        await self._lease_round()
        rt.every(self.cfg.tick_interval, self._tick, "tick")
        rt.every(self.cfg.progress_interval, self._write_progress, "progress")
        rt.every(self.cfg.lease_interval, self._lease_round, "leases")
        self._started.set()
        log.info("detector %s started, owning %d jobs", self.instance, len(self.owned))

    async def stop(self) -> None:
        """Publish what is pending, write progress once more, and hand the jobs back."""
        if self._leases is None:  # start() never ran
            return
        with contextlib.suppress(Exception):
            await self._flush()
        with contextlib.suppress(Exception):
            await self._write_progress()
        with contextlib.suppress(Exception):
            await self.leases.release(self.owned)
            await self.leases.deregister()
        self.owned.clear()

    async def ready(self) -> tuple[bool, str]:
        return self._started.is_set(), f"{len(self.owned)} jobs owned"

    # -- telemetry ----------------------------------------------------------------------
    def on_telemetry(self, msg: TelemetryMessage, subject: str = "") -> None:
        """Subscription callback: decoded by the runtime, judged here (synchronously)."""
        if msg.job in self.owned:
            self.detector.on_telemetry(msg)

    async def _subscribe(self, job: str) -> None:
        # A lost job keeps its subscription (the runtime gives no handle to drop it);
        # on_telemetry ignores jobs we do not own, and a regained job reuses it.
        if job in self.subscribed:
            return
        self.subscribed.add(job)
        for kind in TELEMETRY_KINDS:
            await self.runtime.subscribe_telemetry(self.settings.subjects.pattern(kind, job=job),
                                              self.on_telemetry)

    # -- durable messages ---------------------------------------------------------------
    async def _on_reg(self, msg: RankHello | NodeHello, delivery: Delivery) -> None:
        await self._started.wait()
        now = time.time()
        if not await self._own(msg.job, msg.time, self.cfg.job_idle_expiry):
            return
        if isinstance(msg, RankHello):
            self.detector.on_hello(msg, now)
        else:
            self.detector.on_node_hello(msg, now)
        await self._flush()

    async def _on_exit(self, msg: WorkerExit, delivery: Delivery) -> None:
        await self._started.wait()
        if not await self._own(msg.job, msg.time, self.cfg.exit_max_age):
            return
        self.detector.on_exit(msg, time.time())
        await self._flush()

    async def _on_ckpt(self, msg: CheckpointReport, delivery: Delivery) -> None:
        await self._started.wait()
        if not await self._own(msg.job, msg.time, self.cfg.exit_max_age):
            return
        self.detector.on_checkpoint(msg, time.time())
        await self._flush()

    async def _own(self, job: str, sent: float, max_age: float) -> bool:
        """True if this instance owns ``job`` (taking it if free and ours to take).

        False means "history, acknowledge and ignore"; a job owned elsewhere raises
        :class:`Retry`, so the message comes back until its owner gets it.
        """
        if job in self.owned:
            return True
        if sent and time.time() - sent > max_age:
            return False
        async with self._own_lock:
            if job in self.owned:
                return True
            self.retired.pop(job, None)
            await self.runtime.redis.sadd(self.keys.jobs(), job)
            owner = (await self.leases.owners([job]))[job]
            if owner is None:
                live = await self.leases.heartbeat()
                if preferred(job, live) in (self.instance, None) and await self.leases.acquire(
                        job):
                    await self._adopt(job)
                    return True
        raise Retry(self.cfg.retry_delay, f"job {job} belongs to detector {owner or '?'}")

    async def _adopt(self, job: str) -> None:
        """Take a job over: what is open and what was pending, then its telemetry."""
        redis = self.runtime.redis
        stored = {_text(k): _text(v)
                  for k, v in (await redis.hgetall(self.keys.dedupe(ROLE, job))).items()}
        raw_progress = await redis.get(self.keys.progress(job))
        open_: dict[str, Anomaly] = {}
        for field, value in stored.items():
            if field.startswith(PUBLISHED):
                continue
            try:
                anomaly = load_anomaly(value)
            except ValueError as exc:
                log.warning("job %s: dropping unreadable stored anomaly %s: %s", job, field, exc)
                continue
            if anomaly.rev > int(stored.get(PUBLISHED + field, 0)):
                self._pending.append(Transition(job, field, anomaly))
            if anomaly.status == "open":
                open_[field] = anomaly
        progress = None
        if raw_progress:
            with contextlib.suppress(ValueError):
                progress = decode_progress(raw_progress)
        self.detector.restore(job, open_, progress, time.time())
        self.owned.add(job)
        self._free_since.pop(job, None)
        await self._subscribe(job)
        log.info("detector %s owns job %s (%d open anomalies)", self.instance, job, len(open_))

    def _drop(self, job: str) -> None:
        self.owned.discard(job)
        self.detector.forget(job)
        log.info("detector %s no longer owns job %s", self.instance, job)

    # -- timers -------------------------------------------------------------------------
    async def _tick(self) -> None:
        now = time.time()
        nc = self.runtime.bus.nc
        reconnects = nc.stats["reconnects"]
        if reconnects != self._reconnects or not nc.is_connected:
            # Telemetry sent while we were away is lost to us: silence proves nothing yet.
            self._reconnects = reconnects
            self.detector.grace(now)
        if nc.is_connected:
            self.detector.tick(now)
        await self._flush()

    async def _flush(self) -> None:
        """Persist, then publish, then mark published: every anomaly change, in order."""
        async with self._flush_lock:
            self._pending.extend(self.detector.drain())
            if not self._pending:
                return
            batch = list(self._pending)
            redis = self.runtime.redis
            pipe = redis.pipeline(transaction=False)
            for t in batch:
                pipe.hset(self.keys.dedupe(ROLE, t.job), t.key, dump_anomaly(t.anomaly))
            await pipe.execute()
            sent: list[Transition] = []
            for t in batch:
                started = time.monotonic()
                try:
                    await self.runtime.publish_event(self.settings.subjects.event(t.job, "anomaly"),
                                                t.anomaly)
                except Exception as exc:
                    log.warning("publishing anomaly %s failed (%r); will retry", t.anomaly.id,
                                exc)
                    break
                sent.append(t)
                self._published.labels(t.anomaly.kind, t.anomaly.status).inc()
                if time.monotonic() - started > 1.0:
                    log.warning("publishing anomaly %s took %.1fs", t.anomaly.id,
                                time.monotonic() - started)
                log.info("anomaly %s %s job=%s kind=%s ranks=%s rev=%d", t.anomaly.status,
                         t.anomaly.id, t.job, t.anomaly.kind, t.anomaly.ranks[:16], t.anomaly.rev)
            del self._pending[:len(sent)]
            if not sent:
                return
            pipe = redis.pipeline(transaction=False)
            for t in sent:
                key = self.keys.dedupe(ROLE, t.job)
                if t.anomaly.status == "resolved":
                    pipe.hdel(key, t.key, PUBLISHED + t.key)
                else:
                    pipe.hset(key, PUBLISHED + t.key, str(t.anomaly.rev))
            await pipe.execute()

    async def _write_progress(self) -> None:
        now = time.time()
        pipe = self.runtime.redis.pipeline(transaction=False)
        expiry = max(60, int(self.cfg.job_idle_expiry))
        for job in sorted(self.owned):
            progress = self.detector.progress(job, now)
            if progress is not None and progress.ranks:
                pipe.set(self.keys.progress(job), encode_progress(progress), ex=expiry)
        if len(pipe):
            await pipe.execute()

    async def _lease_round(self) -> None:
        """Renew our leases, let idle jobs go, and take free jobs that are ours to take."""
        started = time.monotonic()
        try:
            await self._leases_once()
        finally:
            took = time.monotonic() - started
            if took > self.cfg.lease_ttl / 2:
                log.warning("detector %s: lease round took %.1fs (TTL %.1fs): jobs may move",
                            self.instance, took, self.cfg.lease_ttl)

    async def _leases_once(self) -> None:
        now = time.time()
        live = await self.leases.heartbeat()
        for job in await self.leases.renew(self.owned):
            self._drop(job)
        for job in list(self.owned):
            state = self.detector.jobs.get(job)
            if state is not None and now - state.last_heard() > self.cfg.job_idle_expiry:
                await self.leases.release([job])
                self._drop(job)
                self.retired[job] = now
        known = [_text(j) for j in await self.runtime.redis.smembers(self.keys.jobs())]
        free = [j for j in known if j not in self.owned and j not in self.retired]
        for job, owner in (await self.leases.owners(free)).items():
            if owner is not None:
                self._free_since.pop(job, None)
                continue
            since = self._free_since.setdefault(job, now)
            if preferred(job, live) != self.instance and now - since < self.cfg.lease_ttl:
                continue
            async with self._own_lock:
                if job not in self.owned and await self.leases.acquire(job):
                    await self._adopt(job)
