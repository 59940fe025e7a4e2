"""Structured logs: the stable context keys, one adapter that binds them, two formats.

Every trainguard process logs through the stdlib :mod:`logging` tree. What this module adds
is the vocabulary of context (:data:`KEYS`: which job, rank, host, step, incident and trace a
line is about) and the two ways to render it:

* ``text`` (the default): ``<time> <LEVEL> <logger>: <message>``, with the bound keys
  appended as ``[job=... rank=...]`` when there are any, so a line without context reads as
  it always has;
* ``json`` (``TRAINGUARD_LOG_FORMAT=json``): one object per line with ``time``, ``level``,
  ``logger``, ``message`` and each key that is set; ``trace_id`` defaults to the current
  span's, so a log aggregator can join the lines of one incident with its trace.

Bind context with :meth:`Log.bind` (``log.bind(job=job).warning(...)``); plain loggers may
pass the same keys through ``extra=``. Both formatters read them off the record.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
from collections.abc import Mapping, MutableMapping
from typing import IO, Any, Final

from opentelemetry import trace

from trainguard.contract.envnames import setting
from trainguard.contract.errors import ConfigError

KEYS: Final = ("job", "rank", "host", "step", "incident", "trace_id")
"""Context keys, in the order the formats show them; never renamed (dashboards use them)."""

FORMATS: Final = ("text", "json")
DEFAULT_FORMAT: Final = "text"
FORMAT_ENV: Final = setting("log_format")
LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR")
DEFAULT_LEVEL: Final = "INFO"
LEVEL_ENV: Final = setting("log_level")
TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class Log(logging.LoggerAdapter[logging.Logger]):
    """A logger with context bound to it; every record it makes carries that context."""

    def bind(self, *, job: str | None = None, rank: int | None = None,
             host: str | None = None, step: int | None = None, incident: str | None = None,
             trace_id: str | None = None) -> Log:
        """A logger with these keys added to the ones already bound (None: not set)."""
        fields = {"job": job, "rank": rank, "host": host, "step": step, "incident": incident,
                  "trace_id": trace_id}
        bound = {**(self.extra or {}), **{k: v for k, v in fields.items() if v is not None}}
        return Log(self.logger, bound)

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any,
                                                                         MutableMapping[str, Any]]:
        # The stdlib adapter replaces a call's ``extra``; merging lets a call add to it.
        kwargs["extra"] = {**(self.extra or {}), **(kwargs.get("extra") or {})}
        return msg, kwargs


def get_logger(name: str) -> Log:
    """The logger ``name`` with nothing bound yet."""
    return Log(logging.getLogger(name), {})


def context(record: logging.LogRecord) -> dict[str, Any]:
    """The context keys set on ``record``, in :data:`KEYS` order."""
    return {k: v for k in KEYS if (v := getattr(record, k, None)) is not None}


def current_trace_id() -> str | None:
    """The W3C trace id of the current span (32 hex digits), None outside a span."""
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


class TextFormatter(logging.Formatter):
    """The human format; context goes at the end of the first line, before a traceback."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        ctx = context(record)
        if not ctx:
            return line
        return f"{line} [{' '.join(f'{k}={v}' for k, v in ctx.items())}]"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, context."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC)
            .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **context(record),
        }
        if "trace_id" not in out and (trace_id := current_trace_id()):
            out["trace_id"] = trace_id
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def formatter(fmt: str) -> logging.Formatter:
    """The formatter of ``fmt`` (``text`` or ``json``); :class:`ConfigError` otherwise."""
    if fmt == "json":
        return JsonFormatter()
    if fmt == "text":
        return TextFormatter()
    raise ConfigError(f"{FORMAT_ENV}={fmt!r}: use one of {', '.join(FORMATS)}")


def level_of(text: str, what: str = LEVEL_ENV) -> str:
    """``text`` as a level name (any case); :class:`ConfigError` naming ``what`` otherwise."""
    level = text.strip().upper()
    if level not in LEVELS:
        raise ConfigError(f"{what}={text!r}: use one of {', '.join(LEVELS)}")
    return level


def configure(level: str | None = None, fmt: str | None = None, *,
              env: Mapping[str, str] | None = None, stream: IO[str] | None = None) -> None:
    """Set up the root logger once per process (like :func:`logging.basicConfig`, a no-op
    if it already has handlers). None: ``TRAINGUARD_LOG_LEVEL`` (else INFO) and
    ``TRAINGUARD_LOG_FORMAT`` (else text)."""
    env = os.environ if env is None else env
    chosen = level_of(level, "--log-level") if level else \
        level_of(env.get(LEVEL_ENV) or DEFAULT_LEVEL)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(formatter(fmt or env.get(FORMAT_ENV) or DEFAULT_FORMAT))
    logging.basicConfig(level=chosen, handlers=[handler])
