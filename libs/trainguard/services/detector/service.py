"""The detector service: a thin async shell around :class:`~.engine.Detector`.

It feeds the pure rules from the bus and writes what they find back out:

* telemetry (``hb``, ``step``, ``fp``, ``gpu``, ``node``) through per-job core
  subscriptions, taken when this instance wins the job's lease (:mod:`.leases`);
* durable consumers on the REPORTS stream: ``reg`` (``RankHello``/``NodeHello``: job
  discovery), ``exit`` (``WorkerExit``: crashes) and ``ckpt`` (slow checkpoints). A
  message of a job another instance owns is redelivered (``Retry``) until its owner
  takes it, so every replica can bind the same durable;
* timers: rules that only time reveals (every ``tick_interval``), ``progress:<job>`` to
  Redis (every ``progress_interval``, one pipeline), leases (every ``lease_interval``),
  and a PING/PONG round trip to NATS (every ``bus_probe_interval``, :mod:`.busview`).

Anomaly changes go out through :class:`~.outbox.AnomalyOutbox` (stored, published, marked
published), which waits for Redis at most ``redis_wait``: detection and publishing go on
while Redis is away, for as long as the job leases are valid by this detector's clock
(:mod:`.leases`). While its own view of the bus is stale the detector judges no silence
(:mod:`.busview`). Its name survives its restart (:mod:`.identity`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import logging
import time
from collections.abc import Sequence
from typing import Any

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from prometheus_client import Counter, Gauge

from trainguard.contract.binding import check_bound
from trainguard.contract.codec import decode_durable
from trainguard.contract.errors import DecodeError, Misaddressed, Retry
from trainguard.contract.schemas import (
    CheckpointReport,
    NodeHello,
    RankHello,
    TelemetryMessage,
    WorkerExit,
)
from trainguard.contract.subjects import stream_name
from trainguard.runtime.config import Settings, load_settings
from trainguard.runtime.jobmetrics import JobMetrics
from trainguard.runtime.presence import Presence
from trainguard.runtime.service import Consumer, Delivery, Runtime, Service
from trainguard.runtime.state import Keys, encode_progress
from trainguard.runtime.store import TRANSIENT_REDIS_ERRORS
from trainguard.runtime.topology import ConsumerSpec

from .book import Transition
from .busview import BusProbe, BusView
from .engine import Detector
from .identity import Identity, default_name
from .leases import ROLE, Leases, preferred
from .outbox import AnomalyOutbox
from .settings import DetectorSettings
from .thresholds import thresholds_of
from .writebehind import Outage

log = logging.getLogger("trainguard.detector")

TELEMETRY_KINDS = ("hb", "step", "fp", "gpu", "node")
REPLAY_MAX = 10_000
"""At most this many of a dead owner's recent exits are read back on taking its job."""


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
        self.instance = default_name(settings.instance_id, settings.health_port)
        """This detector's name in leases (final once :meth:`start` has claimed it)."""
        self.owned: set[str] = set()
        self.subscribed: set[str] = set()
        self.retired: dict[str, float] = {}
        self._free_since: dict[str, float] = {}
        self.elsewhere: dict[str, str] = {}
        """Job -> the other detector whose lease it was under when last read."""
        self.live: frozenset[str] = frozenset()
        """The detectors registered at the last look (us included)."""
        self._own_lock = asyncio.Lock()
        self._started = asyncio.Event()
        self._leases: Leases | None = None
        self._identity: Identity | None = None
        self._outbox: AnomalyOutbox | None = None
        self.redis_outage = Outage("Redis")
        self.bus_view = BusView(settings.bus_stale_after, time.time())
        self._probe: BusProbe | None = None
        self._presence: Presence | None = None
        self._stalls: Any = None
        self._jobs: JobMetrics | None = None

    @property
    def leases(self) -> Leases:
        assert self._leases is not None, "detector not started"
        return self._leases

    @property
    def outbox(self) -> AnomalyOutbox:
        assert self._outbox is not None, "detector not started"
        return self._outbox

    # -- wiring -------------------------------------------------------------------------
    def consumers(self) -> Sequence[Consumer]:
        s = self.settings.subjects
        # Each job's messages in order, the jobs' at once: one job's storm of exits (each
        # handler waits for Redis and the bus) does not hold up another job's crash.
        return [
            Consumer(ConsumerSpec("reports", "detector-reg", (s.pattern("reg"),)),
                     self._on_reg, (RankHello, NodeHello), by_job=True),
            Consumer(ConsumerSpec("reports", "detector-exit", (s.pattern("exit"),)),
                     self._on_exit, (WorkerExit,), by_job=True),
            Consumer(ConsumerSpec("reports", "detector-ckpt", (s.pattern("ckpt"),),
                                  deliver_new=True),
                     self._on_ckpt, (CheckpointReport,), by_job=True),
        ]

    async def start(self, rt: Runtime) -> None:
        published = self._metrics(rt)
        self._outbox = AnomalyOutbox(
            rt.redis, self.keys, self._publish, self.cfg.redis_wait, self.redis_outage,
            published, holder=lambda: self._leases.holder if self._leases is not None else None)
        self._identity = Identity(rt.redis, lambda name: self.settings.redis_key(
            ROLE, "claim", name), self.instance, self.cfg.lease_ttl)
        self.instance = await self._identity.claim()
        self._leases = self._new_leases()
        nc = rt.bus.nc
        self._presence = Presence(nc, self.settings.subjects, ROLE)
        await self._presence.serve(self.instance)  # before any lease names us
        self.bus_view = BusView(self.cfg.bus_stale_after, time.time(), nc.stats["reconnects"])
        self._probe = BusProbe(nc, self.bus_view)
        self._probe.poke()
        if self.cfg.bus_stale_after + self.cfg.bus_probe_interval >= self.cfg.hb_timeout:
            log.warning("bus_stale_after + bus_probe_interval (%.1fs) is not under hb_timeout "
                        "(%.1fs): a stalled bus may be read as silent ranks",
                        self.cfg.bus_stale_after + self.cfg.bus_probe_interval,
                        self.cfg.hb_timeout)
        await self._lease_round()
        rt.every(self.cfg.tick_interval, self._tick, "tick")
        rt.every(self.cfg.progress_interval, self._write_progress, "progress")
        rt.every(self.cfg.lease_interval, self._lease_round, "leases")
        rt.every(self.cfg.bus_probe_interval, self._poke_bus, "bus-probe")
        if self.cfg.peer_probe_interval > 0:
            rt.every(self.cfg.peer_probe_interval, self._probe_peers, "peers")
        self._started.set()
        log.info("detector %s started, owning %d jobs", self.instance, len(self.owned))

    def _metrics(self, rt: Runtime) -> Counter:
        registry = rt.metrics.registry
        self._jobs = JobMetrics(registry)
        self._stalls = Counter("trainguard_detector_bus_stalls",
                               "Times the detector's view of the bus went stale",
                               registry=registry)
        gauges = {
            "jobs": ("Jobs this detector owns", lambda: len(self.owned)),
            "bus_stale_seconds": ("How long the view of the bus has been stale (0: current)",
                                  lambda: self.bus_view.stale_for(time.time())),
            "bus_rtt_seconds": ("Round trip of the last answered bus probe",
                                lambda: self.bus_view.rtt or 0.0),
            "redis_pending_writes": ("Anomaly-state writes waiting for Redis",
                                     lambda: len(self.outbox.writes.pending)
                                     if self._outbox else 0),
        }
        for name, (doc, fn) in gauges.items():
            Gauge(f"trainguard_detector_{name}", doc, registry=registry).set_function(fn)
        return Counter("trainguard_detector_anomalies",
                       "Anomaly changes published, by kind and status",
                       ["kind", "status"], registry=registry)

    def _new_leases(self) -> Leases:
        return Leases(self.runtime.redis, self.keys, self.instance, self.cfg.lease_ttl,
                      self.settings.redis_key(ROLE, "instances"))

    async def stop(self) -> None:
        """Publish what is pending, store it, write progress once more, and hand the jobs
        back at once (deregistered first, so the others' hashing no longer prefers us)."""
        if self._leases is None:  # start() never ran
            return
        if self._probe is not None:
            await self._probe.close()
        if self._presence is not None:
            await self._presence.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._write_progress(), 2.0)
        await self.outbox.close(3.0, self.detector.drain())
        with contextlib.suppress(Exception):
            await self.leases.deregister()
            await self.leases.release(self.owned)
            if self._identity is not None:
                await self._identity.release()
        self.owned.clear()

    async def ready(self) -> tuple[bool, str]:
        stale = self.bus_view.stale_for(time.time())
        if stale:
            return False, f"view of the bus stale for {stale:.1f}s"
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
        if self.redis_outage.down:
            raise Retry(self.cfg.retry_delay * 4, f"job {job}: Redis is away, ownership unknown")
        owner = self.elsewhere.get(job)
        if owner in self.live:
            # Another live detector holds it (as of the last lease round): no Redis round
            # trip, and no wait for the lock behind other jobs' messages; back at once.
            raise Retry(self.cfg.owned_retry_delay, f"job {job} belongs to detector {owner}")
        async with self._own_lock:
            if job in self.owned:
                return True
            self.retired.pop(job, None)
            await self.runtime.redis.sadd(self.keys.jobs(), job)
            owner = (await self.leases.owners([job]))[job]
            if owner in (None, self.instance):
                self.elsewhere.pop(job, None)
                live = await self.leases.heartbeat()
                self.live = frozenset(live)
                ours = owner == self.instance or preferred(job, live) in (self.instance, None)
                if ours and await self.leases.acquire(job):
                    await self._adopt(job)
                    return True
            else:
                self.elsewhere[job] = owner
        if owner is not None and owner in self.live:
            raise Retry(self.cfg.owned_retry_delay, f"job {job} belongs to detector {owner}")
        raise Retry(self.cfg.retry_delay, f"job {job} belongs to detector {owner or '?'}")

    async def _adopt(self, job: str) -> None:
        """Take a job over: what is open and what was pending, then its telemetry."""
        state = await self.outbox.load(job, self.cfg.lease_ttl)
        self.detector.restore(job, state.open, state.progress, time.time())
        self.owned.add(job)
        self._free_since.pop(job, None)
        self.elsewhere.pop(job, None)
        await self._subscribe(job)
        log.info("detector %s owns job %s (%d open anomalies; its state read in %.0f ms: "
                 "%d values, %d bytes)", self.instance, job, len(state.open),
                 state.seconds * 1000, state.fields, state.bytes)

    def _drop(self, job: str) -> None:
        self.owned.discard(job)
        if self._jobs is not None:
            self._jobs.forget(job)
        self.detector.forget(job)
        log.info("detector %s no longer owns job %s", self.instance, job)

    # -- timers -------------------------------------------------------------------------
    async def _tick(self) -> None:
        now = time.time()
        for job in self.leases.lapsed(self.owned, time.monotonic()):
            log.warning("detector %s: the lease of job %s may have expired (Redis did not "
                        "renew it): not judging the job until Redis is back", self.instance, job)
            self._drop(job)
        nc = self.runtime.bus.nc
        view = self.bus_view
        stalls, stalled_for = view.stalls, view.stale_for(now)
        verdict = view.observe(now, nc.is_connected, nc.stats["reconnects"])
        if verdict != "current":
            # Telemetry is not reaching us, or arrives late: silence proves nothing yet.
            self.detector.grace(now)
        if view.stalls != stalls:
            self._stalls.inc()
            log.warning("detector %s: no answer from the NATS server for %.1fs (stalled or "
                        "disconnected): one bus fault, not failing ranks; no silence or hang "
                        "is judged until it answers", self.instance, now - view.confirmed)
        elif verdict == "recovered":
            log.warning("detector %s: the bus answers again after %.1fs; silence is judged "
                        "again after one hb_timeout", self.instance, stalled_for)
        if verdict != "stale":
            self.detector.tick(now)
        await self._flush()

    async def _poke_bus(self) -> None:
        if self._probe is not None:
            self._probe.poke()

    async def _flush(self) -> None:
        await self.outbox.flush(self.detector.drain())

    async def _publish(self, t: Transition) -> None:
        await self.runtime.publish_event(self.settings.subjects.event(t.job, "anomaly"),
                                         t.anomaly)

    async def _write_progress(self) -> None:
        """``progress:<job>`` of every owned job; best effort (the next one supersedes it)."""
        self.outbox.writes.kick()  # retries what an outage left unwritten
        now = time.time()
        pipe = self.runtime.redis.pipeline(transaction=False)
        expiry = max(60, int(self.cfg.job_idle_expiry))
        for job in sorted(self.owned):
            progress = self.detector.progress(job, now)
            if progress is not None and progress.ranks:
                pipe.set(self.keys.progress(job), encode_progress(progress), ex=expiry)
                if self._jobs is not None:
                    self._jobs.observe(progress, now)
        if len(pipe) and not self.redis_outage.down:
            try:
                await pipe.execute()
            except TRANSIENT_REDIS_ERRORS as exc:
                self.redis_outage.failed("writing progress", exc)

    async def _lease_round(self) -> None:
        """Renew our leases, let idle jobs go, and take free jobs that are ours to take."""
        started = time.monotonic()
        try:
            await self._leases_once()
            self.redis_outage.answered()
        except TRANSIENT_REDIS_ERRORS as exc:
            self.redis_outage.failed("renewing leases", exc)
        finally:
            took = time.monotonic() - started
            if took > self.cfg.lease_ttl / 2:
                log.warning("detector %s: lease round took %.1fs (TTL %.1fs): jobs may move",
                            self.instance, took, self.cfg.lease_ttl)

    async def _leases_once(self) -> None:
        now = time.time()
        if self._identity is not None and not await self._identity.keep():
            await self._step_aside(self._identity)
        live = await self.leases.heartbeat()
        self.live = frozenset(live)
        for job in await self.leases.renew(self.owned):
            self._drop(job)
        for job in list(self.owned):
            state = self.detector.jobs.get(job)
            if state is not None and now - state.last_heard() > self.cfg.job_idle_expiry:
                await self.leases.release([job])
                self._drop(job)
                self.retired[job] = now
        known = [j.decode() if isinstance(j, bytes) else j
                 for j in await self.runtime.redis.smembers(self.keys.jobs())]
        free = [j for j in known if j not in self.owned and j not in self.retired]
        for job, owner in (await self.leases.owners(free)).items():
            if owner not in (None, self.instance):  # ours: a process before us held it
                self._free_since.pop(job, None)
                self.elsewhere[job] = owner
                continue
            self.elsewhere.pop(job, None)
            since = self._free_since.setdefault(job, now)
            if (owner is None and preferred(job, live) != self.instance
                    and now - since < self.cfg.lease_ttl):
                continue
            async with self._own_lock:
                if job not in self.owned and await self.leases.acquire(job):
                    await self._adopt(job)

    async def _probe_peers(self) -> None:
        """Take over at once the jobs of a detector whose NATS connection is gone: its
        leases would keep them unwatched until they expire (``lease_ttl``)."""
        presence = self._presence
        assert presence is not None
        owners = sorted(set(self.elsewhere.values()) - {self.instance})
        # At once: asking after a live one waits out the request's timeout.
        gone = await asyncio.gather(*(presence.absent(owner) for owner in owners))
        for owner in (o for o, g in zip(owners, gone, strict=True) if g):
            presence.forget(owner)
            await self.leases.deregister(owner)
            live = await self.leases.heartbeat()
            self.live = frozenset(live)
            jobs = sorted(j for j, o in self.elsewhere.items() if o == owner)
            log.warning("detector %s: detector %s is gone from the bus; taking over the "
                        "jobs hashing gives us of its %d", self.instance, owner, len(jobs))
            for job in jobs:
                if preferred(job, live) not in (self.instance, None):
                    continue  # another survivor's (or the lease's expiry's)
                async with self._own_lock:
                    if job in self.owned or not await self.leases.take_from(job, owner):
                        continue
                    await self._adopt(job)
                await self._replay_exits(job)

    async def _replay_exits(self, job: str) -> None:
        """The job's exits of the last ``ack_wait``, read from the stream: those the dead
        owner had fetched, or that the server sent to its last pull request before it
        noticed the connection gone, come back only after the consumer's ``ack_wait``
        (30 s: a crash right at the kill was seen 32 s late). Handling an exit twice
        changes nothing (its crash is open already)."""
        spec = next(c.spec for c in self.consumers() if c.spec.durable == "detector-exit")
        since = datetime.datetime.fromtimestamp(time.time() - spec.ack_wait, datetime.UTC)
        sub = await self.runtime.bus.js.pull_subscribe(
            self.settings.subjects.pattern("exit", job=job),
            stream=stream_name(self.settings.prefix, spec.stream),
            config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME,
                                  opt_start_time=since,
                                  ack_policy=AckPolicy.NONE, inactive_threshold=10.0))
        replayed = 0
        try:
            while replayed < REPLAY_MAX:
                try:
                    msgs = await sub.fetch(256, timeout=0.5)
                except TimeoutError:
                    break
                for msg in msgs:
                    with contextlib.suppress(DecodeError, Misaddressed):  # as the consumer
                        ex = decode_durable(msg.data, WorkerExit)  # would dead-letter them
                        check_bound(self.settings.subjects, msg.subject, ex)
                        self.detector.on_exit(ex, time.time())
                replayed += len(msgs)
                if msgs[-1].metadata.num_pending == 0:
                    break
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        await self._flush()
        log.info("detector %s: %d exits of job %s replayed from the stream", self.instance,
                 replayed, job)

    async def _step_aside(self, identity: Identity) -> None:
        """Another live process took our name: its jobs are its own; we go on as another."""
        for job in list(self.owned):
            self._drop(job)
        self.instance = await identity.step_aside()
        self._leases = self._new_leases()
        if self._presence is not None:
            await self._presence.serve(self.instance)
