"""Settling durable messages: a message's failure is that message's, never its consumer's.

* ok -> ``ack`` after the handler returns;
* :class:`Retry`, or a transient Redis/NATS error -> delayed redelivery (a dependency
  outage delays work instead of losing it) until the message is ``transient_max_s`` old,
  then the dead-letter subject, which keeps it for a replay; a Retry's delay is jittered
  (:func:`retry_delay`). Wrong Redis credentials raise as a connection error but are no
  outage: they count as a handler failure;
* :class:`Reject`, an undecodable, wrongly typed or oversized message, one whose body names
  another job, rank or host than its subject (:mod:`trainguard.contract.binding`), a handler whose
  publish was refused as too large, or one that failed ``max_deliver`` times -> the
  dead-letter subject with the reason (published *before* the ``term``: in an interest
  stream a terminated message may be gone when anyone looks for it);
* a dead letter that cannot be published -> redelivery while that may be transient and
  deliveries remain, else ``term`` with a log line.

:meth:`Settler.settle` never raises: whatever goes wrong on the way, even here, is counted
(``trainguard_message_errors``), logged and the message dead-lettered or terminated. An
exception out of it would end the consumer's task, and each restart of the service would
meet the same message again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
from nats.aio.msg import Msg
from nats.js.errors import Error as JetStreamError
from opentelemetry import trace
from opentelemetry.context import Context

from trainguard.contract.binding import check_bound
from trainguard.contract.codec import decode_any_durable
from trainguard.contract.envelope import H_TYPE, normalize_headers
from trainguard.contract.errors import DecodeError, MessageTooLarge, Misaddressed, Reject, Retry
from trainguard.contract.schemas import Durable
from trainguard.core import tracing
from trainguard.runtime.topology import ConsumerSpec

from .bus import UNACKED_PUBLISH_ERRORS, Bus
from .deadletter import MAX_REASON, clip
from .logs import Log
from .metrics import ErrorReason, Metrics
from .store import PERMANENT_REDIS_ERRORS, TRANSIENT_REDIS_ERRORS

TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    *TRANSIENT_REDIS_ERRORS, *UNACKED_PUBLISH_ERRORS, nats.errors.ConnectionClosedError,
)

DEAD_LETTER_RETRY_ERRORS: tuple[type[BaseException], ...] = (JetStreamError, *TRANSIENT_ERRORS)
"""Failures of a dead-letter publish worth a redelivery (the bus or the stream away)."""


def redelivery_delay(deliveries: int) -> float:
    """Backoff for the n-th failed delivery: 0.2 s doubling to a 10 s cap."""
    return float(min(10.0, 0.2 * 2 ** max(0, deliveries - 1)))


def retry_delay(delay: float) -> float:
    """A :class:`Retry`'s redelivery delay, jittered by +-50 %.

    A Retry mostly means "not mine": several replicas share one consumer and only one
    may handle the message (a job's owner, the leader). With a fixed delay the server's
    redelivery can fall, round after round, on the pull request of the replica that just
    refused it, which re-pulls at once (two detectors bounced each other's exits for a
    minute that way); jitter breaks that rhythm.
    """
    return delay * random.uniform(0.5, 1.5)


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


@dataclasses.dataclass(frozen=True)
class Consumer:
    """A durable consumer and the handler its messages go to.

    ``accepts`` lists the message types this consumer handles; anything else that arrives
    on its subjects is dead-lettered as a wrong type.
    """

    spec: ConsumerSpec
    handler: DurableHandler
    accepts: tuple[type[Durable], ...]
    by_job: bool = False
    """Settle the messages of different jobs at once, each job's in order
    (:mod:`trainguard.runtime.lanes`): for handlers that wait on I/O and keep no order
    across jobs, so that one job's burst does not hold up the others'."""


def decode_reason(exc: DecodeError) -> ErrorReason:
    """How a message that does not decode is counted: over its size limit, in another
    sender's name than its subject's, or not ours."""
    if isinstance(exc, MessageTooLarge):
        return "oversized"
    return "misaddressed" if isinstance(exc, Misaddressed) else "malformed"


def delivery_facts(msg: Msg) -> tuple[dict[str, str], int]:
    """Headers (normalised) and the delivery count, whatever shape the message has."""
    try:
        headers = normalize_headers(msg.headers)
    except Exception:
        headers = {}
    try:
        deliveries = int(msg.metadata.num_delivered)
    except Exception:
        deliveries = 1
    return headers, deliveries


def message_age(msg: Msg) -> float | None:
    """Seconds since JetStream stored ``msg`` (None when it does not say)."""
    try:
        return time.time() - msg.metadata.timestamp.timestamp()
    except Exception:
        return None


class Settler:
    """Settles the messages of one service's durable consumers."""

    def __init__(self, *, service: str, bus: Bus, metrics: Metrics, tracer: trace.Tracer,
                 max_deliver: int, log_for: Callable[[str], Log],
                 transient_max_s: float = 3600.0) -> None:
        self.service = service
        self.bus = bus
        self.metrics = metrics
        self.tracer = tracer
        self.max_deliver = max_deliver
        self.transient_max_s = transient_max_s
        self.log_for = log_for

    async def settle(self, consumer: Consumer, msg: Msg) -> None:
        """Settle ``msg``; never raises (see the module docstring)."""
        try:
            await self._settle(consumer, msg)
        except Exception as exc:
            name = consumer.spec.durable
            self.metrics.error(name, "internal")
            self.log_for(msg.subject).exception("%s: settling a message on %s failed",
                                                name, msg.subject)
            headers, deliveries = delivery_facts(msg)
            await self._dead(consumer, msg, headers, deliveries,
                             f"settling failed: {exc!r}", "internal")

    async def _settle(self, consumer: Consumer, msg: Msg) -> None:
        name = consumer.spec.durable
        headers, deliveries = delivery_facts(msg)
        try:
            body = decode_any_durable(msg.data, headers.get(H_TYPE))
            check_bound(self.bus.subjects, msg.subject, body)
        except DecodeError as exc:
            kind = decode_reason(exc)
            self.metrics.error(name, kind)
            await self._dead(consumer, msg, headers, deliveries, exc.reason, kind)
            return
        if not isinstance(body, consumer.accepts):
            self.metrics.error(name, "wrong_type")
            await self._dead(consumer, msg, headers, deliveries,
                             f"{type(body).__name__} is not accepted on consumer {name} "
                             f"(expects {', '.join(t.__name__ for t in consumer.accepts)})",
                             "malformed")
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
                await self._nak(consumer, msg, retry_delay(exc.delay), "retry")
            except Reject as exc:
                self.metrics.error(name, "rejected")
                await self._dead(consumer, msg, headers, deliveries, exc.reason, "rejected")
            except MessageTooLarge as exc:  # what it would publish never fits: no retry
                self.metrics.error(name, "publish_too_large")
                await self._dead(consumer, msg, headers, deliveries,
                                 f"the handler's publish was refused: {exc.reason}",
                                 "publish_too_large")
            except TRANSIENT_ERRORS as exc:
                if isinstance(exc, PERMANENT_REDIS_ERRORS):
                    span.record_exception(exc)
                    await self._failed(consumer, msg, headers, deliveries, exc)
                    return
                self.metrics.error(name, "transient")
                age = message_age(msg)
                if age is not None and age > self.transient_max_s:
                    await self._dead(consumer, msg, headers, deliveries,
                                     f"transient failures for {age:.0f} s (past "
                                     f"transient_max_s {self.transient_max_s:.0f} s), last: "
                                     f"{exc!r}", "transient_expired")
                    return
                self.log_for(msg.subject).warning(
                    "%s: transient failure on %s (%r); redelivering", name, msg.subject, exc)
                await self._nak(consumer, msg, redelivery_delay(deliveries), "transient")
            except Exception as exc:
                span.record_exception(exc)
                await self._failed(consumer, msg, headers, deliveries, exc)
            else:
                with contextlib.suppress(Exception):
                    await msg.ack()
                self._count(consumer, "ack")
            finally:
                self.metrics.latency.labels(self.service, name).observe(
                    time.perf_counter() - started)

    async def _failed(self, consumer: Consumer, msg: Msg, headers: dict[str, str],
                      deliveries: int, exc: BaseException) -> None:
        """The handler failed: redelivered, or dead-lettered after ``max_deliver``."""
        name = consumer.spec.durable
        self.metrics.error(name, "handler_error")
        if deliveries >= self.max_deliver:
            reason = f"handler failed {deliveries} times, last: {exc!r}"
            await self._dead(consumer, msg, headers, deliveries, reason, "handler_failed")
        else:
            self.log_for(msg.subject).warning(
                "%s: handler failed on %s (delivery %d): %r", name, msg.subject,
                deliveries, exc)
            await self._nak(consumer, msg, redelivery_delay(deliveries), "failed")

    def _count(self, consumer: Consumer, outcome: str) -> None:
        self.metrics.messages.labels(self.service, consumer.spec.durable, outcome).inc()

    async def _nak(self, consumer: Consumer, msg: Msg, delay: float, outcome: str) -> None:
        with contextlib.suppress(Exception):
            await msg.nak(delay=delay)
        self._count(consumer, outcome)

    async def _dead(self, consumer: Consumer, msg: Msg, headers: dict[str, str],
                    deliveries: int, reason: str, kind: str) -> None:
        """Dead-letter, then ``term``; never raises."""
        name = consumer.spec.durable
        log = self.log_for(msg.subject)
        try:
            await self.bus.dead_letter(subject=msg.subject, payload=msg.data, reason=reason,
                                       service=self.service, consumer=name, headers=headers,
                                       deliveries=deliveries)
        except Exception as exc:
            self.metrics.error(name, "dead_letter_failed")
            if isinstance(exc, DEAD_LETTER_RETRY_ERRORS) and deliveries < self.max_deliver:
                log.warning("dead-lettering failed (%r); will redeliver", exc)
                await self._nak(consumer, msg, 1.0, "dead_letter_failed")
                return
            log.error("dead-lettering %s from %s failed (%r); terminated without a letter: "
                      "%s", msg.subject, name, exc, clip(reason, MAX_REASON))
            with contextlib.suppress(Exception):
                await msg.term()
            self._count(consumer, "term")
            return
        with contextlib.suppress(Exception):
            await msg.term()
        log.warning("dead-lettered %s from %s: %s", msg.subject, name,
                    clip(reason, MAX_REASON))
        self.metrics.dead.labels(self.service, kind).inc()
        self._count(consumer, "dead")
