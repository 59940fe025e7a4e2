"""Where a process's spans go: the OpenTelemetry SDK's provider and exporters.

A service, the agent or ``trainguard up`` calls :func:`setup_tracing` once; ranks and
libraries only use the API (:mod:`trainguard.core.tracing`, which also reads
``OTEL_PROPAGATORS``). The standard ``OTEL_*`` variables work as the SDK defines them, read
by the SDK's own classes where it has them:

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
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final

from opentelemetry import trace

from trainguard.contract.envnames import setting
from trainguard.contract.errors import ConfigError
from trainguard.core.tracing import propagator

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

log = logging.getLogger("trainguard.runtime.telemetry")
EXPORTER_ENV: Final = setting("otel_exporter")
_setup_lock = threading.Lock()
_configured = False
_processors: Callable[[], list[SpanProcessor]] | None = None
_providers: dict[str, trace.TracerProvider] = {}


def exporters(explicit: str | None = None,
              env: Mapping[str, str] | None = None) -> list[str]:
    """The exporters to install: ``explicit`` (the ``otel_exporter`` setting), else
    ``TRAINGUARD_OTEL_EXPORTER``, else ``OTEL_TRACES_EXPORTER``, else ``otlp`` when an OTLP
    endpoint is set; an empty list exports nothing."""
    env = os.environ if env is None else env
    own = explicit or env.get(EXPORTER_ENV, "")
    if own:
        if own in ("none", "console", "otlp") or own.startswith("file:"):
            return [] if own == "none" else [own]
        raise ConfigError(f"{EXPORTER_ENV}={own!r}: use none, console, file:<path> or otlp")
    std = [s.strip() for s in env.get("OTEL_TRACES_EXPORTER", "").split(",") if s.strip()]
    for s in std:
        if s not in ("otlp", "console", "none"):
            raise ConfigError(f"OTEL_TRACES_EXPORTER={env['OTEL_TRACES_EXPORTER']!r}: "
                              f"{s!r} is not supported; use otlp, console or none")
    if std:
        return [s for s in std if s != "none"]
    if env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return ["otlp"]
    return []


def _otlp_exporter() -> Any:
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or \
        os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf"
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcExporter,
            )

            return GrpcExporter()
        if protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter as HttpExporter,
            )

            return HttpExporter()
    except ImportError as exc:
        raise ConfigError(f"OTLP export ({protocol}) needs the 'otlp' extra: pip install "
                          f"'trainguard[otlp]' ({exc.name} is missing)") from exc
    raise ConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: use http/protobuf or grpc")


def _processor_factory(specs: list[str]) -> Callable[[], list[SpanProcessor]]:
    """Builds the span processors of one tracer provider; checks ``specs`` at once."""
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SimpleSpanProcessor,
    )

    from .spanfile import JsonLinesSpanExporter

    files: dict[str, JsonLinesSpanExporter] = {}  # one handle per file, shared by providers

    def build() -> list[SpanProcessor]:
        out: list[SpanProcessor] = []
        for spec in specs:
            if spec == "console":
                out.append(BatchSpanProcessor(ConsoleSpanExporter()))
            elif spec.startswith("file:"):
                # Simple processor: a span is on disk when it ends, so a test that kills
                # the process right after still finds it.
                path = spec[len("file:"):]
                exp = files.get(path) or files.setdefault(path, JsonLinesSpanExporter(path))
                out.append(SimpleSpanProcessor(exp))
            elif spec == "otlp":
                out.append(BatchSpanProcessor(_otlp_exporter()))
        return out

    if "otlp" in specs:
        _otlp_exporter()  # a missing extra or a bad protocol fails at setup, not later
    return build


def _provider(service_name: str, processors: Callable[[], list[SpanProcessor]],
              *, explicit: bool) -> TracerProvider:
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider

    # Resource.create reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES; a name given
    # here wins over them, so give one only where it must (one of several services).
    attrs = {SERVICE_NAME: service_name} if explicit or not os.environ.get(
        "OTEL_SERVICE_NAME") else {}
    provider = TracerProvider(resource=Resource.create(attrs))
    for p in processors():
        provider.add_span_processor(p)
    return provider


def _sdk_disabled() -> bool:
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def setup_tracing(service_name: str, exporter: str | None = None, *,
                  several: bool = False) -> None:
    """Install an SDK tracer provider once per process (later calls are ignored).

    ``several``: the process runs several services (``trainguard up``), and
    :func:`service_tracer` gives each its own provider and ``service.name``.
    """
    global _configured, _processors
    with _setup_lock:
        if _configured:
            return
        propagator(strict=True)  # a bad OTEL_PROPAGATORS fails at start
        if not _sdk_disabled():
            processors = _processor_factory(exporters(exporter))
            trace.set_tracer_provider(_provider(service_name, processors, explicit=False))
            _processors = processors if several else None
        _configured = True


def service_tracer(service: str, name: str | None = None) -> trace.Tracer:
    """The tracer of one service in this process, whose spans carry its own
    ``service.name`` (``<OTEL_SERVICE_NAME or trainguard>-<service>``) when the process
    runs several (``trainguard up``); the process's tracer otherwise."""
    instrumentation = name or f"trainguard.{service}"
    with _setup_lock:
        if _processors is None:
            return trace.get_tracer(instrumentation)
        provider = _providers.get(service)
        if provider is None:
            base = os.environ.get("OTEL_SERVICE_NAME") or "trainguard"
            provider = _providers[service] = _provider(f"{base}-{service}", _processors,
                                                       explicit=True)
    return provider.get_tracer(instrumentation)


def read_spans(path: str) -> list[dict[str, Any]]:
    """Spans a ``file:`` exporter wrote (for tests and ``trainguard incidents``)."""
    try:
        with open(path, encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.strip()]
    except FileNotFoundError:
        return []
