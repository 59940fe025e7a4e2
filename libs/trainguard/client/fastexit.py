"""A rank that crashes while its peers wait to recover in place ends at once.

In-place recovery waits for the failed rank's process to end: only then does its agent
start the replacement (the process still holds its GPU memory and its sockets). A Python
process that dies of an unhandled exception first runs every exit handler and tears the
interpreter down, which took 0.4-0.7 s of the survivors' wait on a busy node. Here, once
the traceback is printed (and torchelastic's ``@record`` wrote its error file, which
happens before), the Guard flushes its own reports and the process ends with ``os._exit``:
its agent sees the exit at once (:func:`trainguard.agent.procs.wait_exit`).

Exit handlers other libraries registered do not run on that path; ``TRAINGUARD_FAST_EXIT=0``
(or ``Guard(fast_exit=False)``) keeps them, at the cost of the survivors' wait. Only an
``Exception`` ends the process early: ``KeyboardInterrupt`` and ``SystemExit`` exit as
always.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Final

EXIT_CODE: Final = 1
"""Python's own exit status for an unhandled exception."""
FLUSH_S: Final = 2.0
"""The most the Guard's flush may take on that path (its usual close waits longer)."""

_installed: list[Callable[[], None]] = []
"""The flush of the one Guard whose crash ends the process (the newest to ask)."""


def install(flush: Callable[[], None]) -> None:
    """End the process right after an unhandled exception's traceback, once ``flush`` ran
    (bounded by its caller). Idempotent: a second call only replaces the flush."""
    if _installed:
        _installed[0] = flush
        return
    _installed.append(flush)
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException,
             tb: TracebackType | None) -> None:
        if not issubclass(kind, Exception):
            previous(kind, value, tb)
            return
        try:
            _report(previous, kind, value, tb)
            _installed[0]()
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(EXIT_CODE)

    sys.excepthook = hook


def _report(previous: Callable[[type[BaseException], BaseException, TracebackType | None],
                               object],
            kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    """Print what ``previous`` would (a user's hook still runs) straight to the process's
    own stderr. The hooks above this one may not finish: each ``init_process_group`` wraps
    ``sys.excepthook`` in one that collects the text in a buffer and writes it, with the
    rank's prefix, only once the hooks below it return, which this one's exit prevents."""
    buffer = io.StringIO()
    shown, sys.stderr = sys.stderr, buffer
    try:
        previous(kind, value, tb)
    except Exception:  # a broken hook must not hide the error
        buffer.write("".join(traceback.format_exception(kind, value, tb)))
    finally:
        sys.stderr = shown
    text = buffer.getvalue() or "".join(traceback.format_exception(kind, value, tb))
    text += (f"trainguard: {kind.__name__} ended this rank; its peers wait for its exit, so "
             "it exits now (TRAINGUARD_FAST_EXIT=0 runs the exit handlers)\n")
    data = text.encode(errors="replace")
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(2, data):]
