"""``/livez``, ``/readyz`` and ``/metrics`` on a small asyncio HTTP server.

Liveness proves the event loop answers and the process can still do its work: it fails
(503 with the reason) once the live check names one, such as a consumer's task that died,
since only a restart brings that back. It never depends on NATS or Redis, or a Redis blip
would get every pod restarted. Readiness is a list of named checks (NATS connected,
consumers bound, Redis answers, the service's own): ``/readyz`` answers 200 with the
service's word when all pass, else 503 with the first failure; ``/readyz?verbose`` lists
every check, one ``[+] name: detail`` or ``[-] name: detail`` line each (the Kubernetes
API server's format), with the same status code.

The server binds ``health_host`` (default ``127.0.0.1``; ``0.0.0.0`` for a kubelet probe
or a Prometheus scrape from another pod).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from .httpd import SmallHttpServer, reply


@dataclass(frozen=True)
class Check:
    """One readiness check's verdict."""

    name: str
    ok: bool
    detail: str


ReadyCheck = Callable[[], Awaitable[list[Check]]]
LiveCheck = Callable[[], str | None]
"""Why the process is not alive, or None: synchronous, so a busy loop cannot time it out."""


class HealthServer(SmallHttpServer):
    what = "the health server"

    def __init__(self, registry: CollectorRegistry, ready: ReadyCheck,
                 live: LiveCheck | None = None) -> None:
        super().__init__()
        self._registry = registry
        self._ready = ready
        self._live = live

    async def respond(self, method: str, target: str, writer: asyncio.StreamWriter) -> None:
        await reply(writer, *await self._route(target))

    async def _route(self, target: str) -> tuple[str, str, bytes]:
        url = urlsplit(target)
        path, query = url.path, parse_qs(url.query, keep_blank_values=True)
        if path == "/livez":
            why = self._live() if self._live else None
            if why:
                return "503 Service Unavailable", "text/plain", f"{why}\n".encode()
            return "200 OK", "text/plain", b"ok\n"
        if path == "/readyz":
            try:
                checks = await asyncio.wait_for(self._ready(), 3.0)
            except Exception as exc:
                checks = [Check("checks", False, f"check failed: {exc!r}")]
            ok = all(c.ok for c in checks)
            if "verbose" in query:
                body = "".join(f"[{'+' if c.ok else '-'}] {c.name}: {c.detail}\n"
                               for c in checks)
                body += f"readyz check {'passed' if ok else 'failed'}\n"
            else:
                body = f"{summary(checks)}\n"
            return ("200 OK" if ok else "503 Service Unavailable"), "text/plain", body.encode()
        if path == "/metrics":
            return "200 OK", CONTENT_TYPE_LATEST, generate_latest(self._registry)
        return "404 Not Found", "text/plain", b"not found\n"


def summary(checks: list[Check]) -> str:
    """The one-line answer of ``/readyz``: the first failure, else the last check's word."""
    for c in checks:
        if not c.ok:
            return c.detail
    return checks[-1].detail if checks else "ready"
