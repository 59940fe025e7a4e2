"""HTTP POST to a sink, with the standard library in a worker thread.

The services' environment has no async HTTP client (no aiohttp, no httpx), and one POST
per incident change is far too rare to be worth a dependency: ``urllib`` in
``asyncio.to_thread``, bounded by a timeout, does it (TLS, proxies from the environment,
redirects included). Errors name the sink and the host, never the full URL (a Slack
webhook's path is its secret).
"""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from urllib.parse import urlsplit

from trainguard.contract.errors import ConfigError, TrainguardError

from .payloads import Request


class SinkError(TrainguardError):
    """A sink did not take a notification: unreachable, or it answered an error."""

    def __init__(self, sink: str, url: str, why: str, status: int | None = None) -> None:
        self.sink, self.status = sink, status
        host = urlsplit(url).netloc or url[:40]
        super().__init__(f"{sink} at {host}: {why}")

    @property
    def permanent(self) -> bool:
        """The sink refused this request itself (a 4xx other than 408/429): sending it
        again would be refused again."""
        return self.status is not None and 400 <= self.status < 500 \
            and self.status not in (408, 429)


def _post(sink: str, url: str, req: Request, timeout: float) -> int:
    request = urllib.request.Request(url, data=req.body, headers=req.headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        detail = exc.read(300).decode("utf-8", "replace").strip()
        raise SinkError(sink, url, f"HTTP {exc.code} {detail}".strip(), exc.code) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise SinkError(sink, url, f"unreachable ({reason})") from None


async def post(sink: str, url: str, req: Request, timeout: float) -> int:
    """POST ``req`` to ``url``; the HTTP status, or :class:`SinkError`."""
    return await asyncio.to_thread(_post, sink, url, req, timeout)


def check_url(setting: str, url: str) -> str:
    """``url`` if it is an http(s) URL; a :class:`~trainguard.contract.errors.ConfigError` naming
    ``setting`` otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        # Only the start of the value: a webhook URL's path is its secret.
        raise ConfigError(f"setting {setting}={url[:12]!r}... is not an http(s) URL: expected "
                          "http://host:port/...")
    return url.rstrip("/") if setting == "alertmanager_url" else url
