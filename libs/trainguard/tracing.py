"""OpenTelemetry setup for processes, and trace context in NATS headers.

Libraries and the trainer client use the OTel API only; a process that wants spans calls
:func:`setup_tracing` once. Exporters, by ``TRAINGUARD_OTEL_EXPORTER``:

* ``none`` (default): spans are created but not exported.
* ``console``: one JSON span per line on stderr.
* ``file:<path>``: JSON lines appended to ``path``, so tests can join the spans that
  several processes wrote into one trace.
* ``otlp`` or any ``OTEL_EXPORTER_OTLP_ENDPOINT``: the OTLP/HTTP exporter (extra ``otlp``).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .envnames import setting
from .errors import ConfigError

_propagator = TraceContextTextMapPropagator()
_setup_lock = threading.Lock()
_configured = False


def inject(headers: dict[str, str], ctx: Context | None = None) -> dict[str, str]:
    """Write W3C ``traceparent`` (of ``ctx`` or the current span) into ``headers``."""
    _propagator.inject(headers, context=ctx)
    return headers


def extract(headers: Mapping[str, str] | None) -> Context:
    """The trace context a message's headers carry (an empty context if none)."""
    return _propagator.extract(dict(headers or {}))


def tracer(name: str = "trainguard") -> trace.Tracer:
    return trace.get_tracer(name)


def setup_tracing(service_name: str, exporter: str | None = None) -> None:
    """Install an SDK tracer provider once per process (later calls are ignored)."""
    global _configured
    with _setup_lock:
        if _configured:
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SimpleSpanProcessor,
            SpanExporter,
        )

        spec = exporter or os.environ.get(setting("otel_exporter"), "")
        if not spec and os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            spec = "otlp"
        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        if spec in ("", "none"):
            pass
        elif spec == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        elif spec.startswith("file:"):
            # Simple processor: a span is on disk when it ends, so a test that kills the
            # process right after still finds it.
            from .spanfile import JsonLinesSpanExporter

            exp: SpanExporter = JsonLinesSpanExporter(spec[len("file:"):])
            provider.add_span_processor(SimpleSpanProcessor(exp))
        elif spec == "otlp":
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter,
                )
            except ImportError as exc:
                raise ConfigError(
                    "OTLP export needs the 'otlp' extra: pip install 'trainguard[otlp]'"
                ) from exc
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        else:
            raise ConfigError(
                f"TRAINGUARD_OTEL_EXPORTER={spec!r}: use none, console, file:<path> or otlp"
            )
        trace.set_tracer_provider(provider)
        _configured = True


def read_spans(path: str) -> list[dict[str, Any]]:
    """Spans a ``file:`` exporter wrote (for tests and ``trainguard incidents``)."""
    try:
        with open(path, encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.strip()]
    except FileNotFoundError:
        return []
