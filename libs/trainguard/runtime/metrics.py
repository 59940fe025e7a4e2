"""The Prometheus series every service exposes, on a registry of its own.

Besides the plumbing below, each registry carries ``trainguard_build_info`` and the
standard process, platform and GC collectors (``process_*``, ``python_*``), so memory, CPU
and restarts of every service can be graphed and alerted on. The series about jobs and
incidents are in :mod:`trainguard.runtime.jobmetrics`.
"""

from __future__ import annotations

import platform
from typing import Literal

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    Info,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from trainguard import __version__

ErrorReason = Literal[
    "malformed", "wrong_type", "oversized", "misaddressed", "rejected", "handler_error",
    "publish_too_large", "transient", "dead_letter_failed", "callback_error", "internal",
]
"""Why a message raised on its way through a consumer (``trainguard_message_errors``):
what it was (``malformed``, ``wrong_type``, ``oversized``, ``misaddressed``: a body in
another sender's name than its subject's), what its handler did
(``rejected``, ``handler_error``, ``publish_too_large``, ``transient``, ``callback_error``
for a core subscription), or what went wrong settling it (``dead_letter_failed``,
``internal``: a bug in the settle path). A fixed vocabulary keeps the series few."""


class Metrics:
    def __init__(self, service: str) -> None:
        self.registry = CollectorRegistry()
        self.service = service
        # The default registry's collectors are process-wide; each service's own registry
        # gets its own instances (several services share a process under `trainguard up`).
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        Info("trainguard_build", "The trainguard build serving this endpoint",
             registry=self.registry).info({"version": __version__, "service": service,
                                           "python": platform.python_version()})
        self.messages = Counter("trainguard_messages", "Durable messages settled, by outcome",
                                ["service", "consumer", "outcome"], registry=self.registry)
        self.dead = Counter("trainguard_dead_letters", "Messages sent to the dead-letter subject",
                            ["service", "reason"], registry=self.registry)
        self.errors = Counter("trainguard_message_errors",
                              "Exceptions caught per message, so the consumer went on",
                              ["service", "consumer", "reason"], registry=self.registry)
        self.latency = Histogram("trainguard_handler_seconds", "Handler latency",
                                 ["service", "consumer"], registry=self.registry,
                                 buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5))
        self.telemetry = Counter("trainguard_telemetry", "Telemetry messages received",
                                 ["service", "outcome"], registry=self.registry)
        self.slow_consumer = Counter("trainguard_slow_consumer_errors",
                                     "NATS slow-consumer errors (telemetry dropped by the client)",
                                     ["service"], registry=self.registry)

    def error(self, consumer: str, reason: ErrorReason) -> None:
        """Count one exception a consumer (durable or core) caught and went on from."""
        self.errors.labels(self.service, consumer, reason).inc()

