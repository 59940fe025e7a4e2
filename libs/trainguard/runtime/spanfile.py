"""A span exporter that appends JSON lines to a file, so several processes' spans can be
joined into one trace afterwards (tests, ``trainguard incidents``)."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import IO

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


class JsonLinesSpanExporter(SpanExporter):
    """One compact JSON object per finished span; O_APPEND keeps concurrent lines whole."""

    def __init__(self, path: str) -> None:
        self._lock = threading.Lock()
        self._fh: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            for span in spans:
                self._fh.write(json.dumps(json.loads(span.to_json()), separators=(",", ":")))
                self._fh.write("\n")
            self._fh.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._fh.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
