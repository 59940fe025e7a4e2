"""The service base: a thin async shell that wires pure rules to NATS and Redis.

A service declares its durable consumers (:class:`Consumer`) and, in :meth:`Service.start`,
its telemetry subscriptions and timers. :func:`run_service` does the rest, the same way
for every service:

* connects (bounded first connect, endless reconnects), provisions the topology,
  creates each durable pull consumer explicitly, then binds it;
* settles every message at least once: ack after the handler returns;
  :class:`Retry` or a transient Redis/NATS error -> delayed redelivery (never dead-lettered,
  so a dependency outage delays work instead of losing it); :class:`Reject`, an
  undecodable message or a handler that failed ``max_deliver`` times -> the dead-letter
  subject with the reason (published *before* the ``term``), counted, and the service
  goes on;
* runs each handler inside a CONSUMER span whose parent is the producer's trace context;
* serves ``/livez``, ``/readyz`` and ``/metrics``; stops on SIGTERM/SIGINT by draining.

:class:`Service` is generic over its settings type (``Service[DetectorSettings]`` types
``self.settings``) and owns its runtime: :attr:`Service.runtime` is the running
:class:`Runtime`, or :class:`~trainguard.errors.NotStarted` naming the service when used
before start. A plain ``Service`` subclass is ``Service[Settings]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, ClassVar, Generic

import nats.errors
import redis.asyncio as aioredis
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import Error as JetStreamError
from opentelemetry import trace
from opentelemetry.context import Context
from prometheus_client import CollectorRegistry, Counter, Histogram
from typing_extensions import TypeVar

from . import tracing
from .bus import Bus, connect_nats
from .codec import decode_any_durable, decode_telemetry
from .config import Settings
from .envelope import H_TYPE, normalize_headers
from .errors import DecodeError, NotStarted, Reject, Retry
from .health import HealthServer
from .logs import Log, get_logger
from .schemas import Durable, TelemetryMessage
from .store import TRANSIENT_REDIS_ERRORS, connect_redis
from .topology import ConsumerSpec, ensure_consumer, provision, streams

log = get_logger("trainguard.service")

S = TypeVar("S", bound=Settings, default=Settings)
"""A service's settings type; the default keeps plain ``Service`` subclasses typed."""

TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    *TRANSIENT_REDIS_ERRORS, nats.errors.TimeoutError, nats.errors.ConnectionClosedError,
    nats.errors.NoRespondersError, TimeoutError,
)

DEAD_LETTER_ERRORS: tuple[type[BaseException], ...] = (JetStreamError, *TRANSIENT_ERRORS)


def redelivery_delay(deliveries: int) -> float:
    """Backoff for the n-th failed delivery: 0.2 s doubling to a 10 s cap."""
    return float(min(10.0, 0.2 * 2 ** max(0, deliveries - 1)))


@dataclasses.dataclass(frozen=True)
class Delivery:
    """What a handler knows about the message besides its body."""

    subject: str
    headers: dict[str, str]
    deliveries: int
    ctx: Context
    msg: Msg

    async def in_progress(self) -> None:
        """Extend the ack deadline during long work."""
        await self.msg.in_progress()


DurableHandler = Callable[[Any, Delivery], Awaitable[None]]
TelemetryHandler = Callable[[TelemetryMessage, str], None]


@dataclasses.dataclass(frozen=True)
class Consumer:
    """A durable consumer and the handler its messages go to.

    ``accepts`` lists the message types this consumer handles; anything else that arrives
    on its subjects is dead-lettered as a wrong type.
    """

    spec: ConsumerSpec
    handler: DurableHandler
    accepts: tuple[type[Durable], ...]


class Metrics:
    """The Prometheus series every service exposes, on a registry of its own."""

    def __init__(self, service: str) -> None:
        self.registry = CollectorRegistry()
        self.service = service
        self.messages = Counter("trainguard_messages", "Durable messages settled, by outcome",
                                ["service", "consumer", "outcome"], registry=self.registry)
        self.dead = Counter("trainguard_dead_letters", "Messages sent to the dead-letter subject",
                            ["service", "reason"], registry=self.registry)
        self.latency = Histogram("trainguard_handler_seconds", "Handler latency",
                                 ["service", "consumer"], registry=self.registry,
                                 buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5))
        self.telemetry = Counter("trainguard_telemetry", "Telemetry messages received",
                                 ["service", "outcome"], registry=self.registry)
        self.slow_consumer = Counter("trainguard_slow_consumer_errors",
                                     "NATS slow-consumer errors (telemetry dropped by the client)",
                                     ["service"], registry=self.registry)


class Runtime:
    """Everything a running service may use: bus, Redis, settings, metrics, tasks."""

    def __init__(self, service: Service[Any], settings: Settings) -> None:
        self.service = service
        self.settings = settings
        self.metrics = Metrics(service.name)
        self.tracer = tracing.tracer(f"trainguard.{service.name}")
        self._bus: Bus | None = None
        self._redis: aioredis.Redis | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._bound: set[str] = set()
        self._dead_queue: asyncio.Queue[tuple[str, bytes, str]] = asyncio.Queue(maxsize=1000)
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

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run ``coro`` until the service stops; a crash is logged, never silent."""
        task = asyncio.create_task(coro, name=f"{self.service.name}:{name}")
        self._tasks.add(task)

        def _done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None and not self.stopping.is_set():
                log.error("task %s crashed: %r", t.get_name(), t.exception(),
                          exc_info=t.exception())

        task.add_done_callback(_done)
        return task

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

        self.spawn(_loop(), name)

    async def subscribe_telemetry(self, subject: str, handler: TelemetryHandler,
                                  *, queue: str = "") -> Subscription:
        """A core subscription whose messages are decoded, and dead-lettered if they don't.

        ``handler`` is synchronous on purpose: telemetry rules are pure and fast, and a
        slow callback would back up into dropped messages.
        """
        # Counter children looked up once: per message the lookup would cost ~1.5 µs.
        ok = self.metrics.telemetry.labels(self.service.name, "ok")
        malformed = self.metrics.telemetry.labels(self.service.name, "malformed")
        failed = self.metrics.telemetry.labels(self.service.name, "handler_error")

        async def _cb(msg: Msg) -> None:
            try:
                decoded = decode_telemetry(msg.data)
            except DecodeError as exc:
                malformed.inc()
                with contextlib.suppress(asyncio.QueueFull):
                    self._dead_queue.put_nowait((msg.subject, msg.data, exc.reason))
                return
            ok.inc()
            try:
                handler(decoded, msg.subject)
            except Exception:  # one bad message must not stop the stream
                failed.inc()
                self.log_for(msg.subject).exception("telemetry handler failed on %s",
                                                    msg.subject)

        sub = await self.bus.nc.subscribe(subject, queue=queue, cb=_cb,
                                          pending_msgs_limit=500_000,
                                          pending_bytes_limit=256 * 1024 * 1024)
        # The server knows the subscription once this returns: "ready" means listening.
        await self.bus.nc.flush()
        return sub

    async def publish_event(self, subject: str, msg: Durable, ctx: Context | None = None) -> None:
        """Publish a durable message inside a PRODUCER span (the trace goes on downstream)."""
        with self.tracer.start_as_current_span(
            f"publish {subject}", context=ctx, kind=trace.SpanKind.PRODUCER,
            attributes={"messaging.system": "nats", "messaging.destination.name": subject},
        ):
            await self.bus.publish_durable(subject, msg)

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
        service._runtime = self  # from here on its handlers may run
        await provision(self.bus.js, streams(s.prefix))
        for consumer in service.consumers():
            self.spawn(self._consume(consumer), f"consume:{consumer.spec.durable}")
        self.spawn(self._dead_letter_pump(), "dead-letters")
        self.health = HealthServer(self.metrics.registry, self.ready)
        await self.health.start(s.health_host, s.health_port)
        await service.start(self)
        log.info("service %s ready (health on %s:%d)", service.name, s.health_host,
                 self.health.port)

    async def ready(self) -> tuple[bool, str]:
        wanted = {c.spec.durable for c in self.service.consumers()}
        if self._bus is None or not self._bus.connected:
            return False, "nats: disconnected"
        if missing := wanted - self._bound:
            return False, f"consumers not bound: {', '.join(sorted(missing))}"
        try:
            await asyncio.wait_for(self.redis.ping(), 1.0)
        except Exception as exc:
            return False, f"redis: {exc!r}"
        ok, detail = await self.service.ready()
        return ok, detail or "ready"

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
        while not self.stopping.is_set():
            try:
                stream = await ensure_consumer(self.bus.js, self.settings.prefix, spec)
                sub = await self.bus.js.pull_subscribe_bind(spec.durable, stream)
                break
            except Exception as exc:
                log.warning("binding consumer %s failed (%r); retrying", spec.durable, exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), 1.0)
        else:
            return
        self._bound.add(spec.durable)
        try:
            while not self.stopping.is_set():
                try:
                    msgs = await sub.fetch(self.settings.fetch_batch, timeout=1.0)
                except (TimeoutError, nats.errors.TimeoutError):
                    continue
                except Exception as exc:
                    log.debug("fetch on %s failed: %r", spec.durable, exc)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.stopping.wait(), 0.5)
                    continue
                for msg in msgs:
                    await self._settle(consumer, msg)
        finally:
            self._bound.discard(spec.durable)
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _settle(self, consumer: Consumer, msg: Msg) -> None:
        name = consumer.spec.durable
        headers = normalize_headers(msg.headers)
        try:
            deliveries = msg.metadata.num_delivered
        except Exception:
            deliveries = 1
        try:
            body = decode_any_durable(msg.data, headers.get(H_TYPE))
            if not isinstance(body, consumer.accepts):
                raise DecodeError(
                    f"{type(body).__name__} is not accepted on consumer {name} "
                    f"(expects {', '.join(t.__name__ for t in consumer.accepts)})"
                )
        except DecodeError as exc:
            await self._dead(consumer, msg, headers, deliveries, exc.reason, "malformed")
            return
        ctx = tracing.extract(headers)
        delivery = Delivery(msg.subject, headers, deliveries, ctx, msg)
        started = time.perf_counter()
        with self.tracer.start_as_current_span(
            f"process {msg.subject}", context=ctx, kind=trace.SpanKind.CONSUMER,
            attributes={"messaging.system": "nats", "messaging.destination.name": msg.subject,
                        "messaging.consumer.group.name": name},
        ) as span:
            try:
                await consumer.handler(body, delivery)
            except Retry as exc:
                span.set_attribute("trainguard.outcome", "retry")
                await self._nak(consumer, msg, exc.delay, "retry")
            except Reject as exc:
                await self._dead(consumer, msg, headers, deliveries, exc.reason, "rejected")
            except TRANSIENT_ERRORS as exc:
                self.log_for(msg.subject).warning(
                    "%s: transient failure on %s (%r); redelivering", name, msg.subject, exc)
                await self._nak(consumer, msg, redelivery_delay(deliveries), "transient")
            except Exception as exc:
                span.record_exception(exc)
                if deliveries >= self.settings.max_deliver:
                    reason = f"handler failed {deliveries} times, last: {exc!r}"
                    await self._dead(consumer, msg, headers, deliveries, reason, "handler_failed")
                else:
                    self.log_for(msg.subject).warning(
                        "%s: handler failed on %s (delivery %d): %r", name, msg.subject,
                        deliveries, exc)
                    await self._nak(consumer, msg, redelivery_delay(deliveries), "failed")
            else:
                with contextlib.suppress(Exception):
                    await msg.ack()
                self.metrics.messages.labels(self.service.name, name, "ack").inc()
            finally:
                self.metrics.latency.labels(self.service.name, name).observe(
                    time.perf_counter() - started)

    async def _nak(self, consumer: Consumer, msg: Msg, delay: float, outcome: str) -> None:
        with contextlib.suppress(Exception):
            await msg.nak(delay=delay)
        self.metrics.messages.labels(self.service.name, consumer.spec.durable, outcome).inc()

    async def _dead(self, consumer: Consumer, msg: Msg, headers: dict[str, str],
                    deliveries: int, reason: str, kind: str) -> None:
        """Dead-letter first, then ``term``: in an interest stream a terminated message
        may be gone by the time anyone looks for it."""
        try:
            await self.bus.dead_letter(subject=msg.subject, payload=msg.data, reason=reason,
                                       service=self.service.name, headers=headers,
                                       deliveries=deliveries)
        except DEAD_LETTER_ERRORS as exc:
            self.log_for(msg.subject).warning("dead-lettering failed (%r); will redeliver", exc)
            await self._nak(consumer, msg, 1.0, "dead_letter_failed")
            return
        with contextlib.suppress(Exception):
            await msg.term()
        self.log_for(msg.subject).warning("dead-lettered %s from %s: %s", msg.subject,
                                          consumer.spec.durable, reason)
        self.metrics.dead.labels(self.service.name, kind).inc()
        self.metrics.messages.labels(self.service.name, consumer.spec.durable, "dead").inc()

    async def _dead_letter_pump(self) -> None:
        """Publishes dead letters for malformed telemetry off the subscription callback."""
        while not self.stopping.is_set():
            try:
                subject, data, reason = await asyncio.wait_for(self._dead_queue.get(), 1.0)
            except TimeoutError:
                continue
            try:
                await self.bus.dead_letter(subject=subject, payload=data, reason=reason,
                                           service=self.service.name)
                self.metrics.dead.labels(self.service.name, "malformed").inc()
            except Exception as exc:
                self.log_for(subject).warning("could not dead-letter telemetry from %s: %r",
                                              subject, exc)


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
