"""Structured logs: bound keys reach both formats; JSON lines carry the current trace."""

from __future__ import annotations

import io
import json
import logging
import sys
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext

from trainguard.contract.errors import ConfigError
from trainguard.runtime import logs


@pytest.fixture
def captured() -> Iterator[tuple[logs.Log, list[logging.LogRecord]]]:
    """A logger of its own whose records are kept (the root's handlers stay untouched)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    base = logging.getLogger("trainguard.test-logs")
    handler = Keep()
    base.addHandler(handler)
    base.setLevel(logging.DEBUG)
    base.propagate = False
    try:
        yield logs.get_logger(base.name), records
    finally:
        base.removeHandler(handler)
        base.propagate = True


def test_bind_adds_to_what_is_bound_and_calls_add_more(
        captured: tuple[logs.Log, list[logging.LogRecord]]) -> None:
    log, records = captured
    job_log = log.bind(job="j1", rank=None)
    job_log.bind(rank=3).warning("slow")
    job_log.info("plain", extra={"incident": "inc-1"})
    log.info("nothing bound")
    assert [logs.context(r) for r in records] == [
        {"job": "j1", "rank": 3}, {"job": "j1", "incident": "inc-1"}, {}]
    assert job_log.extra == {"job": "j1"}  # binding made a new logger


def _record(msg: str = "hello %s", args: tuple[object, ...] = ("world",),
            **ctx: object) -> logging.LogRecord:
    record = logging.LogRecord("trainguard.x", logging.WARNING, __file__, 1, msg, args, None)
    record.__dict__.update(ctx)
    return record


def test_text_format_is_unchanged_without_context_and_appends_it_in_key_order() -> None:
    fmt = logs.TextFormatter()
    assert fmt.format(_record()).endswith(" WARNING trainguard.x: hello world")
    line = fmt.format(_record(incident="i9", job="j", host="node-a", rank=2))
    assert line.endswith(" WARNING trainguard.x: hello world [job=j rank=2 host=node-a "
                         "incident=i9]")


def test_json_format_has_the_fields_and_the_current_trace() -> None:
    fmt = logs.JsonFormatter()
    out = json.loads(fmt.format(_record(job="j", step=40)))
    assert set(out) == {"time", "level", "logger", "message", "job", "step"}
    assert (out["level"], out["logger"], out["message"], out["job"], out["step"]) == \
        ("WARNING", "trainguard.x", "hello world", "j", 40)
    assert out["time"].endswith("Z") and "T" in out["time"]
    span = NonRecordingSpan(SpanContext(trace_id=0xABC, span_id=0x1, is_remote=False))
    with trace.use_span(span):
        inside = json.loads(fmt.format(_record()))
        bound = json.loads(fmt.format(_record(trace_id="mine")))
    assert inside["trace_id"] == f"{0xABC:032x}"
    assert bound["trace_id"] == "mine"


def test_json_format_keeps_the_traceback_in_the_one_line() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    line = logs.JsonFormatter().format(record)
    assert "\n" not in line
    assert "ValueError: boom" in json.loads(line)["exc"]


@pytest.mark.parametrize(("fmt", "env", "want"), [
    (None, {}, logs.TextFormatter),
    (None, {"TRAINGUARD_LOG_FORMAT": "json"}, logs.JsonFormatter),
    ("text", {"TRAINGUARD_LOG_FORMAT": "json"}, logs.TextFormatter),
])
def test_configure_picks_the_format(fmt: str | None, env: dict[str, str],
                                    want: type[logging.Formatter]) -> None:
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers.clear()
    try:
        logs.configure("INFO", fmt, env=env, stream=io.StringIO())
        assert isinstance(root.handlers[0].formatter, want)
    finally:
        root.handlers[:] = saved


def test_an_unknown_format_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="TRAINGUARD_LOG_FORMAT='xml': use one of text, json"):
        logs.configure("INFO", env={"TRAINGUARD_LOG_FORMAT": "xml"})
