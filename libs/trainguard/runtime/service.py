"""The service base: a thin async shell that wires pure rules to NATS and Redis.

A service declares its durable consumers (:class:`Consumer`) and, in :meth:`Service.start`,
its telemetry subscriptions and timers. :func:`run_service` does the rest, the same way
for every service:

* connects (bounded first connect, endless reconnects), provisions the topology,
  creates each durable pull consumer explicitly, then binds it;
* settles every message at least once (:mod:`.settle`): one message's failure, whatever
  it is, is that message's; it is counted, dead-lettered or terminated, and the consumer
  goes on;
* isolates core-NATS callbacks the same way (:meth:`Runtime.subscribe`,
  :meth:`Runtime.isolate`);
* runs each handler inside a CONSUMER span whose parent is the producer's trace context;
* serves ``/livez`` (fails once a vital task, a consumer or a timer, has ended before
  stop: an orchestrator then restarts the pod), ``/readyz`` and ``/metrics``; stops on
  SIGTERM/SIGINT by draining.

:class:`Service` is generic over its settings type (``Service[DetectorSettings]`` types
``self.settings``) and owns its runtime: :attr:`Service.runtime` is the running
:class:`Runtime`, or :class:`~trainguard.contract.errors.NotStarted` naming the service when used
before start. A plain ``Service`` subclass is ``Service[Settings]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, ClassVar, Final, Generic

import nats.errors
import redis.asyncio as aioredis
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry import trace
from opentelemetry.context import Context
from typing_extensions import TypeVar

from trainguard.contract.binding import check_bound
from trainguard.contract.codec import decode_telemetry
from trainguard.contract.errors import DecodeError, NotStarted
from trainguard.contract.schemas import Durable, TelemetryMessage
from trainguard.core.connection import flush
from trainguard.runtime import telemetry
from trainguard.runtime.topology import ensure_consumer, provision, streams

from .bus import Bus, connect_nats
from .config import Settings
from .health import Check, HealthServer, summary
from .lanes import LANES_BATCHES, Lanes
from .logs import Log, get_logger
from .metrics import ErrorReason, Metrics
from .ports import health_port
from .settle import (
    TRANSIENT_ERRORS,
    Consumer,
    Delivery,
    DurableHandler,
    Settler,
    decode_reason,
    redelivery_delay,
)
from .store import connect_redis

__all__ = [
    "TRANSIENT_ERRORS", "Consumer", "CoreCallback", "Delivery", "DurableHandler", "Metrics",
    "Runtime", "Service", "TelemetryHandler", "redelivery_delay", "run_service",
]

log = get_logger("trainguard.runtime.service")

S = TypeVar("S", bound=Settings, default=Settings)
"""A service's settings type; the default keeps plain ``Service`` subclasses typed."""

TelemetryHandler = Callable[[TelemetryMessage, str], None]
CoreCallback = Callable[[Msg], Awaitable[None]]
DEAD_QUEUE: Final = 1000
"""Dead letters from core subscriptions waiting for the pump; beyond, they are dropped
(counted as ``dead_letter_failed``): a flood of junk must not grow memory."""


class Runtime:
    """Everything a running service may use: bus, Redis, settings, metrics, tasks."""

    def __init__(self, service: Service[Any], settings: Settings) -> None:
        self.service = service
        self.settings = settings
        self.metrics = Metrics(service.name)
        self.tracer = telemetry.service_tracer(service.name)
        self._bus: Bus | None = None
        self._redis: aioredis.Redis | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._bound: set[str] = set()
        self._dead_queue: asyncio.Queue[tuple[str, bytes, str, str, ErrorReason]] = \
            asyncio.Queue(maxsize=DEAD_QUEUE)
        self._ended: list[str] = []
        self._settler: Settler | None = None
        self.health: HealthServer | None = None
        self.stopping = asyncio.Event()

    @property
    def bus(self) -> Bus:
        if self._bus is None:
            raise NotStarted(f"the bus of {self.service.name}")
        return self._bus

    @property
    def redis(self) -> aioredis.Redis:
        if self._redis is None:
            raise NotStarted(f"the Redis client of {self.service.name}")
        return self._redis

    def log_for(self, subject: str) -> Log:
        """The service log with the job of ``subject`` bound (none if it names no job)."""
        return log.bind(job=self.settings.subjects.job_of(subject))

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str, *,
              vital: bool = False) -> asyncio.Task[Any]:
        """Run ``coro`` until the service stops; a crash is logged, never silent.

        ``vital``: a loop meant to run until stop (a consumer, a timer, a pump). Ending
        before stop, whether by a crash, a cancel or a return, fails ``/livez`` from then
        on: the service cannot do its work, and only a restart brings the loop back. A
        task of one request or one incident is not vital: its crash is logged.
        """
        task = asyncio.create_task(coro, name=f"{self.service.name}:{name}")
        self._tasks.add(task)

        def _done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            if self.stopping.is_set():
                return
            exc = None if t.cancelled() else t.exception()
            if exc is not None:
                log.error("task %s crashed: %r", t.get_name(), exc, exc_info=exc)
            if vital:
                why = "was cancelled" if t.cancelled() else \
                    f"crashed: {exc!r}" if exc is not None else "returned"
                self._ended.append(f"task {t.get_name()} {why}")
                log.error("vital task %s %s before stop: /livez fails", t.get_name(), why)

        task.add_done_callback(_done)
        return task

    def live(self) -> str | None:
        """Why the service is not alive (a vital task ended before stop), or None."""
        if not self._ended:
            return None
        more = len(self._ended) - 3
        return "; ".join(self._ended[:3]) + (f"; and {more} more" if more > 0 else "")

    def every(self, seconds: float, fn: Callable[[], Awaitable[None]], name: str) -> None:
        """Call ``fn`` every ``seconds`` until stop; a failing tick is logged, not fatal."""

        async def _loop() -> None:
            while not self.stopping.is_set():
                try:
                    await fn()
                except Exception:
                    log.exception("timer %s failed", name)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), seconds)

        self.spawn(_loop(), name, vital=True)

    async def subscribe_telemetry(self, subject: str, handler: TelemetryHandler,
                                  *, queue: str = "") -> Subscription:
        """A core subscription whose messages are decoded, and dead-lettered if they don't
        or if the body speaks for another job, rank or host than the subject
        (:func:`~trainguard.contract.binding.check_bound`).

        ``handler`` is synchronous on purpose: telemetry rules are pure and fast, and a
        slow callback would back up into dropped messages.
        """
        # Counter children looked up once: per message the lookup would cost ~1.5 µs.
        ok = self.metrics.telemetry.labels(self.service.name, "ok")
        malformed = self.metrics.telemetry.labels(self.service.name, "malformed")
        misaddressed = self.metrics.telemetry.labels(self.service.name, "misaddressed")
        subjects = self.settings.subjects
        failed = self.metrics.telemetry.labels(self.service.name, "handler_error")

        async def _cb(msg: Msg) -> None:
            try:
                decoded = decode_telemetry(msg.data)
                check_bound(subjects, msg.subject, decoded)
            except DecodeError as exc:
                reason = decode_reason(exc)
                (misaddressed if reason == "misaddressed" else malformed).inc()
                self.metrics.error("telemetry", reason)
                self._queue_dead(msg, exc.reason, "telemetry", reason)
                return
            ok.inc()
            try:
                handler(decoded, msg.subject)
            except Exception:  # one bad message must not stop the stream
                failed.inc()
                self.metrics.error("telemetry", "callback_error")
                self.log_for(msg.subject).exception("telemetry handler failed on %s",
                                                    msg.subject)

        sub = await self.bus.nc.subscribe(subject, queue=queue, cb=_cb,
                                          pending_msgs_limit=500_000,
                                          pending_bytes_limit=256 * 1024 * 1024)
        # The server knows the subscription once this returns: "ready" means listening.
        await flush(self.bus.nc)
        return sub

    def isolate(self, cb: CoreCallback, consumer: str) -> CoreCallback:
        """``cb`` with each message isolated, for a core-NATS subscription.

        A :class:`DecodeError` (the callback's to raise for what it cannot read)
        dead-letters the message; any other exception is counted and logged. Either way
        the next message is served: ``consumer`` names the subscription in the metrics
        (``trainguard_message_errors``) and in the dead letter.
        """

        async def _isolated(msg: Msg) -> None:
            try:
                await cb(msg)
            except DecodeError as exc:
                reason = decode_reason(exc)
                self.metrics.error(consumer, reason)
                self._queue_dead(msg, exc.reason, consumer, reason)
            except Exception:
                self.metrics.error(consumer, "callback_error")
                self.log_for(msg.subject).exception("%s: callback failed on %s", consumer,
                                                    msg.subject)

        return _isolated

    async def subscribe(self, subject: str, cb: CoreCallback, *, consumer: str,
                        queue: str = "") -> Subscription:
        """A core-NATS subscription, each message isolated (:meth:`isolate`); the server
        knows it once this returns."""
        sub = await self.bus.nc.subscribe(subject, queue=queue, cb=self.isolate(cb, consumer))
        await flush(self.bus.nc)
        return sub

    def _queue_dead(self, msg: Msg, reason: str, consumer: str, kind: ErrorReason) -> None:
        """Hand a core message to the dead-letter pump: a callback must not wait on it."""
        try:
            self._dead_queue.put_nowait((msg.subject, msg.data, reason, consumer, kind))
        except asyncio.QueueFull:  # a flood: the message goes unrecorded, but counted
            self.metrics.error(consumer, "dead_letter_failed")

    async def publish_event(self, subject: str, msg: Durable, ctx: Context | None = None) -> None:
        """Publish a durable message inside a PRODUCER span (the trace goes on downstream),
        retrying for ``publish_retry_s`` while JetStream does not acknowledge it."""
        with self.tracer.start_as_current_span(
            f"publish {subject}", context=ctx, kind=trace.SpanKind.PRODUCER,
            attributes={"messaging.system": "nats", "messaging.destination.name": subject},
        ):
            await self.bus.publish_durable(subject, msg,
                                           retry_for=self.settings.publish_retry_s)

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        s = self.settings
        service = self.service

        async def _error_cb(exc: Exception) -> None:
            if isinstance(exc, nats.errors.SlowConsumerError):
                self.metrics.slow_consumer.labels(service.name).inc()
            else:
                log.debug("nats: %r", exc)

        access = s.access
        nc = await connect_nats(s.nats_url, name=f"trainguard-{service.name}",
                                timeout=s.connect_timeout, error_cb=_error_cb,
                                access=access.nats_options())
        self._bus = Bus(nc, s.subjects, source=f"trainguard/{service.name}")
        self._redis = await connect_redis(s.redis_url, timeout=s.connect_timeout,
                                          access=access.redis_options())
        self._settler = Settler(service=service.name, bus=self._bus, metrics=self.metrics,
                                tracer=self.tracer, max_deliver=s.max_deliver,
                                log_for=self.log_for, transient_max_s=s.transient_max_s)
        service._runtime = self  # from here on its handlers may run
        await provision(self.bus.js, streams(s.prefix, replicas=s.stream_replicas))
        for consumer in service.consumers():
            self.spawn(self._consume(consumer), f"consume:{consumer.spec.durable}", vital=True)
        self.spawn(self._dead_letter_pump(), "dead-letters", vital=True)
        self.health = HealthServer(self.metrics.registry, self.checks, self.live)
        await self.health.start(s.health_host,
                                s.health_port or health_port(service.name, s.base_port))
        await service.start(self)
        log.info("service %s ready (health on %s:%d)", service.name, s.health_host,
                 self.health.port)

    async def ready(self) -> tuple[bool, str]:
        """Ready or not, and the first failure (or the service's word when ready)."""
        checks = await self.checks()
        return all(c.ok for c in checks), summary(checks)

    async def checks(self) -> list[Check]:
        """Every readiness check, in order (``/readyz?verbose`` lists them all)."""
        wanted = {c.spec.durable for c in self.service.consumers()}
        connected = self._bus is not None and self._bus.connected
        out = [Check("nats", connected, "connected" if connected else "nats: disconnected")]
        missing = wanted - self._bound
        out.append(Check("consumers", not missing,
                         f"consumers not bound: {', '.join(sorted(missing))}" if missing
                         else f"bound: {', '.join(sorted(wanted)) or 'none declared'}"))
        try:
            await asyncio.wait_for(self.redis.ping(), 1.0)
            out.append(Check("redis", True, "answers"))
        except Exception as exc:
            out.append(Check("redis", False, f"redis: {exc!r}"))
        try:
            ok, detail = await self.service.ready()
        except Exception as exc:
            ok, detail = False, f"check failed: {exc!r}"
        out.append(Check(self.service.name, ok, detail or "ready"))
        return out

    async def stop(self, grace: float = 10.0) -> None:
        self.stopping.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.service.stop(), grace)
        tasks = list(self._tasks)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=grace)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self.health:
            await self.health.stop()
        if self._bus:
            await self._bus.close()
        if self._redis:
            with contextlib.suppress(Exception):
                await self._redis.aclose()

    # -- consuming ---------------------------------------------------------------------
    async def _consume(self, consumer: Consumer) -> None:
        spec = consumer.spec
        assert self._settler is not None  # set in start(), before any consumer
        settle = self._settler.settle
        while not self.stopping.is_set():
            try:
                stream = await ensure_consumer(self.bus.js, self.settings.prefix, spec,
                                              self.settings.stream_replicas)
                sub = await self.bus.js.pull_subscribe_bind(spec.durable, stream)
                break
            except Exception as exc:
                log.warning("binding consumer %s failed (%r); retrying", spec.durable, exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), 1.0)
        else:
            return
        self._bound.add(spec.durable)
        lanes: Lanes[Msg] | None = None
        if consumer.by_job:
            jobs = self.bus.subjects
            # A bound on messages in hand: a message waiting in its lane is not yet acked,
            # and one waiting longer than ack_wait would be delivered again.
            lanes = Lanes(lambda msg: settle(consumer, msg),
                          lambda msg: jobs.job_of(msg.subject) or "",
                          min(spec.max_ack_pending, LANES_BATCHES * self.settings.fetch_batch))
        try:
            while not self.stopping.is_set():
                try:
                    msgs = await sub.fetch(self.settings.fetch_batch,
                                           timeout=self.settings.fetch_wait)
                except (TimeoutError, nats.errors.TimeoutError):
                    continue
                except Exception as exc:
                    log.debug("fetch on %s failed: %r", spec.durable, exc)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.stopping.wait(), 0.5)
                    continue
                for msg in msgs:
                    if lanes is not None:
                        await lanes.put(msg)  # its job's lane; the loop fetches on
                    else:
                        await settle(consumer, msg)  # never raises: one message stops nothing
        finally:
            if lanes is not None:  # what was fetched is settled before the unsubscribe
                try:
                    await lanes.join()
                except asyncio.CancelledError:
                    lanes.cancel()
                    raise
            self._bound.discard(spec.durable)
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _dead_letter_pump(self) -> None:
        """Publishes dead letters for core messages off their subscriptions' callbacks."""
        while not self.stopping.is_set():
            try:
                subject, data, reason, consumer, kind = await asyncio.wait_for(
                    self._dead_queue.get(), 1.0)
            except TimeoutError:
                continue
            try:
                await self.bus.dead_letter(subject=subject, payload=data, reason=reason,
                                           service=self.service.name, consumer=consumer)
                self.metrics.dead.labels(self.service.name, kind).inc()
            except Exception as exc:
                self.metrics.error(consumer, "dead_letter_failed")
                self.log_for(subject).warning("could not dead-letter %s from %s: %r",
                                              subject, consumer, exc)


class Service(Generic[S]):
    """Base of every trainguard service: declare consumers, start subscriptions and timers.

    Subclasses keep their rules in pure classes and use this only for wiring.
    ``settings_type`` is what the CLI loads for the service; it should be ``S``.
    """

    name: ClassVar[str] = "service"
    settings_type: ClassVar[type[Settings]] = Settings

    def __init__(self, settings: S) -> None:
        self.settings: S = settings
        self._runtime: Runtime | None = None

    @property
    def runtime(self) -> Runtime:
        """The runtime running this service: set once its connections are up."""
        if self._runtime is None:
            raise NotStarted(self.name)
        return self._runtime

    @classmethod
    def unconfigured(cls, settings: Settings) -> str | None:
        """Why this service has nothing to do with ``settings`` (``trainguard up`` skips it
        and says why), or None to run it."""
        return None

    def consumers(self) -> Sequence[Consumer]:
        return ()

    async def start(self, rt: Runtime) -> None:
        """Subscribe to telemetry and start timers (consumers are already running)."""

    async def stop(self) -> None:
        """Flush what must survive; called before the connections close."""

    async def ready(self) -> tuple[bool, str]:
        return True, ""


async def run_service(service: Service[Any], stop: asyncio.Event | None = None,
                      *, install_signals: bool = True,
                      started: Callable[[Runtime], None] | None = None) -> int:
    """Run ``service`` until ``stop`` is set or SIGTERM/SIGINT arrives; returns 0."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    if install_signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    rt = Runtime(service, service.settings)
    try:
        await rt.start()
        if started:
            started(rt)
        await stop.wait()
    finally:
        await rt.stop()
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
    return 0
