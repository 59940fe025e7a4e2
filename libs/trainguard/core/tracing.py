"""Trace context in NATS headers, and tracers, through the OpenTelemetry API alone.

Every process (a rank too) uses only this; a process that wants its spans exported calls
:func:`trainguard.runtime.telemetry.setup_tracing` once (the SDK is the ``services`` and
``agent`` extras'). The standard ``OTEL_*`` variables work as the SDK defines them,
read by the SDK's own classes where it has them:

* ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` (``Resource.create``): the process's
  ``service.name`` (default ``trainguard-<service>``). ``trainguard up`` runs several
  services in one process, each with its own tracer provider and so its own
  ``service.name`` (:func:`service_tracer`): ``<OTEL_SERVICE_NAME or trainguard>-<name>``.
* ``OTEL_TRACES_EXPORTER``: ``otlp``, ``console``, ``none`` (comma-separated), unless
  ``TRAINGUARD_OTEL_EXPORTER`` says otherwise: ``none``, ``console``, ``file:<path>`` (JSON
  lines, so tests can join the spans that several processes wrote into one trace), ``otlp``.
  Neither set: OTLP when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``..._TRACES_ENDPOINT``) is,
  else no export. ``OTEL_SDK_DISABLED=true``: no SDK at all.
* ``OTEL_EXPORTER_OTLP_*`` (endpoint, headers, timeout, certificate, compression,
  ``..._PROTOCOL`` ``http/protobuf`` or ``grpc``): read by the OTLP exporter itself (extra
  ``otlp``); ``OTEL_BSP_*`` by the batch processor.
* ``OTEL_PROPAGATORS`` (``opentelemetry.propagate``, default ``tracecontext,baggage``): what
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
