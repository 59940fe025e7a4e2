"""Trace context in NATS headers, and tracers, through the OpenTelemetry API alone.

Every process (a rank too) uses only this; a process that wants its spans exported calls
:func:`trainguard.runtime.telemetry.setup_tracing` once (the SDK is the ``services`` and
``agent`` extras'; what the other ``OTEL_*`` variables do is said there). This module reads
``OTEL_PROPAGATORS`` (``opentelemetry.propagate``, default ``tracecontext,baggage``): what
:func:`inject` writes into and :func:`extract` reads from NATS headers.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import TextMapPropagator

from trainguard.contract.errors import ConfigError

log = logging.getLogger("trainguard.core.tracing")
_propagator: TextMapPropagator | None = None


def propagator(*, strict: bool = False) -> TextMapPropagator:
    """The propagator ``OTEL_PROPAGATORS`` names (W3C trace context and baggage by
    default). An unknown name is a :class:`ConfigError` naming the variable with
    ``strict`` (a process's setup); otherwise, so that a rank's publish never fails on it,
    W3C trace context with a warning."""
    global _propagator
    if _propagator is None:
        try:
            from opentelemetry import propagate
        except Exception as exc:  # the API raises whatever loading an entry point raised
            why = (f"OTEL_PROPAGATORS={os.environ.get('OTEL_PROPAGATORS')!r}: {exc!r}; use "
                   "tracecontext, baggage (or install the propagator's package)")
            if strict:
                raise ConfigError(why) from None
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )

            log.warning("%s; using W3C trace context", why)
            _propagator = TraceContextTextMapPropagator()
            return _propagator
        _propagator = propagate.get_global_textmap()
    return _propagator


def inject(headers: dict[str, str], ctx: Context | None = None) -> dict[str, str]:
    """Write the trace context (of ``ctx`` or the current span) into ``headers``."""
    propagator().inject(headers, context=ctx)
    return headers


def extract(headers: Mapping[str, str] | None) -> Context:
    """The trace context a message's headers carry (an empty context if none)."""
    return propagator().extract(dict(headers or {}))


def tracer(name: str = "trainguard") -> trace.Tracer:
    return trace.get_tracer(name)
