"""The dashboard's HTTP side: one page, a JSON snapshot, a server-sent event stream.

The same small asyncio server the services' health endpoints use (``asyncio.start_server``,
one request per connection), no framework: ``/`` is the packaged ``index.html``,
``/api/state`` the board's snapshot, ``/events`` an SSE stream that sends a snapshot when
the board changed, at most every ``interval`` seconds (and a comment line as keep-alive),
so a browser's ``EventSource`` updates live and reconnects by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from importlib import resources
from typing import Final

from ..errors import NotStarted
from ..logs import get_logger
from .board import Board, to_json

log = get_logger("trainguard.dashboard")

INTERVAL: Final = 0.5
KEEPALIVE: Final = 15.0


def page() -> bytes:
    """The packaged single page (HTML, CSS and JS in one file; no build step)."""
    return (resources.files(__package__) / "static" / "index.html").read_bytes()


class DashboardServer:
    def __init__(self, board: Board, *, interval: float = INTERVAL) -> None:
        self.board = board
        self.interval = interval
        self._server: asyncio.Server | None = None
        self._page = page()
        self._closing = asyncio.Event()

    @property
    def port(self) -> int:
        if self._server is None:
            raise NotStarted("the dashboard server")
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._handle, host, port)

    async def stop(self) -> None:
        self._closing.set()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), 5.0)
            while (await asyncio.wait_for(reader.readline(), 5.0)) not in (b"\r\n", b"\n", b""):
                pass
            parts = request.decode("latin-1").split()
            method, path = (parts[0], parts[1].split("?", 1)[0]) if len(parts) >= 2 else ("", "")
            if method not in ("GET", "HEAD"):
                await self._reply(writer, "405 Method Not Allowed", "text/plain", b"GET only\n")
            elif path in ("/", "/index.html"):
                await self._reply(writer, "200 OK", "text/html; charset=utf-8", self._page)
            elif path == "/api/state":
                await self._reply(writer, "200 OK", "application/json",
                                  to_json(self.board.snapshot(time.time())))
            elif path == "/events":
                await self._stream(writer)
            else:
                await self._reply(writer, "404 Not Found", "text/plain", b"not found\n")
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    @staticmethod
    async def _reply(writer: asyncio.StreamWriter, status: str, ctype: str, body: bytes) -> None:
        writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: "
                     f"{len(body)}\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n"
                     .encode() + body)
        await writer.drain()

    async def _stream(self, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Cache-Control: no-store\r\nConnection: close\r\n\r\nretry: 1000\n\n")
        sent, quiet = -1, 0.0
        while not self._closing.is_set():
            if self.board.version != sent:
                sent = self.board.version
                writer.write(b"event: state\ndata: " + to_json(self.board.snapshot(time.time()))
                             + b"\n\n")
                quiet = 0.0
            elif quiet >= KEEPALIVE:
                writer.write(b": keep-alive\n\n")
                quiet = 0.0
            await writer.drain()  # a gone browser raises ConnectionError: the stream ends
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), self.interval)
            quiet += self.interval
