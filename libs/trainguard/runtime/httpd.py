"""The one small HTTP/1.1 server under the health endpoints and the dashboard.

Both serve a handful of GET paths to probes, Prometheus and a browser, one request per
connection, so ``asyncio.start_server`` and a request line are all they need: no framework
on the services' stack. A subclass answers :meth:`SmallHttpServer.respond`; slow or gone
clients are dropped after a bounded wait and never reach it.
"""

from __future__ import annotations

import asyncio
import contextlib

from trainguard.contract.errors import NotStarted

_HEADER_WAIT = 5.0


async def reply(writer: asyncio.StreamWriter, status: str, ctype: str, body: bytes,
                extra: str = "") -> None:
    """One complete response; ``extra``: more header lines, each ending in CRLF."""
    writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: "
                 f"{len(body)}\r\n{extra}Connection: close\r\n\r\n".encode() + body)
    await writer.drain()


class SmallHttpServer:
    """Listens, reads one request's line and headers, hands method and target on."""

    what = "the HTTP server"

    def __init__(self) -> None:
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        if self._server is None:
            raise NotStarted(self.what)
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._handle, host, port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    async def respond(self, method: str, target: str, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), _HEADER_WAIT)
            while (await asyncio.wait_for(reader.readline(), _HEADER_WAIT)) not in (
                    b"\r\n", b"\n", b""):
                pass
            parts = request.decode("latin-1").split()
            method, target = (parts[0], parts[1]) if len(parts) >= 2 else ("", "")
            await self.respond(method, target, writer)
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
