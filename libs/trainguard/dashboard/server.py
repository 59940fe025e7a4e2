"""The dashboard's HTTP side: one page, JSON reads, a server-sent event stream.

The same small asyncio server the services' health endpoints use (``asyncio.start_server``,
one request per connection), no framework: ``/`` is the packaged ``index.html``,
``/api/summary`` the board's grouped summary (what the page renders: bounded whatever the
world size), ``/api/cells?job=J`` one heat-map character per rank (fetched only while the
page's heat map is open), ``/api/state`` every rank in full, and ``/events`` an SSE stream
that sends the summary when the board changed, at most every ``interval`` seconds (or
twice the last build, if longer; a comment line as keep-alive), so a browser's
``EventSource`` updates live and reconnects by itself. The summary is built once per board
version, however many pages are open.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from importlib import resources
from typing import Final
from urllib.parse import parse_qs

from trainguard.runtime.httpd import SmallHttpServer, reply
from trainguard.runtime.logs import get_logger

from .board import Board, to_json

log = get_logger("trainguard.dashboard")

INTERVAL: Final = 0.5
KEEPALIVE: Final = 15.0


async def _reply(writer: asyncio.StreamWriter, status: str, ctype: str, body: bytes) -> None:
    await reply(writer, status, ctype, body, extra="Cache-Control: no-store\r\n")


def page() -> bytes:
    """The packaged single page (HTML, CSS and JS in one file; no build step)."""
    return (resources.files(__package__) / "static" / "index.html").read_bytes()


class DashboardServer(SmallHttpServer):
    what = "the dashboard server"

    def __init__(self, board: Board, *, interval: float = INTERVAL,
                 html: bytes | None = None) -> None:
        """``html``: the page served at ``/`` (the packaged one by default; the benchmark
        serves an earlier page beside it)."""
        super().__init__()
        self.board = board
        self.interval = interval
        self._page = html if html is not None else page()
        self._closing = asyncio.Event()
        self._summary: tuple[int, bytes] = (-1, b"")
        self._build_s = 0.0

    def summary(self) -> bytes:
        """The board's summary as JSON, built again only when the board changed."""
        version = self.board.version
        if self._summary[0] != version:
            started = time.perf_counter()
            self._summary = (version, to_json(self.board.summary(time.time())))
            self._build_s = time.perf_counter() - started
        return self._summary[1]

    def pause(self) -> float:
        """Seconds between updates: ``interval``, or twice the last build where that is
        longer, so building summaries never takes over the loop that feeds the board."""
        return max(self.interval, 2 * self._build_s)

    async def stop(self) -> None:
        self._closing.set()
        await super().stop()

    async def respond(self, method: str, target: str, writer: asyncio.StreamWriter) -> None:
        path, _, query = target.partition("?")
        if method not in ("GET", "HEAD"):
            await _reply(writer, "405 Method Not Allowed", "text/plain", b"GET only\n")
        elif path in ("/", "/index.html"):
            await _reply(writer, "200 OK", "text/html; charset=utf-8", self._page)
        elif path == "/api/state":
            await _reply(writer, "200 OK", "application/json",
                         to_json(self.board.snapshot(time.time())))
        elif path == "/api/summary":
            await _reply(writer, "200 OK", "application/json", self.summary())
        elif path == "/api/cells":
            cells = self.board.cells(parse_qs(query).get("job", [""])[0])
            if cells is None:
                await _reply(writer, "404 Not Found", "text/plain", b"no such job\n")
            else:
                await _reply(writer, "200 OK", "application/json", to_json(cells))
        elif path == "/events":
            await self._stream(writer)
        else:
            await _reply(writer, "404 Not Found", "text/plain", b"not found\n")

    async def _stream(self, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Cache-Control: no-store\r\nConnection: close\r\n\r\nretry: 1000\n\n")
        sent, quiet = -1, 0.0
        while not self._closing.is_set():
            if self.board.version != sent:
                sent = self.board.version
                writer.write(b"event: summary\ndata: " + self.summary() + b"\n\n")
                quiet = 0.0
            elif quiet >= KEEPALIVE:
                writer.write(b": keep-alive\n\n")
                quiet = 0.0
            await writer.drain()  # a gone browser raises ConnectionError: the stream ends
            pause = self.pause()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), pause)
            quiet += pause
