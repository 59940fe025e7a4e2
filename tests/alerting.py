"""Real alerting tools for tests: Debian's Alertmanager and promtool, and an HTTP receiver.

:func:`debian_tool` finds a binary, installing its Debian package with apt when it is
missing (idempotent: installed once, found from then on); it skips the test with the
reason only where installing is impossible (not root, no apt).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from trainguard.runtime.embedded import free_port

_apt_lock = threading.Lock()


def debian_tool(binary: str, package: str) -> str:
    """The path of ``binary``, from ``package`` (installed with apt when missing)."""
    found = shutil.which(binary)
    if found:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(f"{binary} is missing and cannot be installed here (needs root and "
                    f"apt-get): apt-get install {package}")
    with _apt_lock:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        cmd = ["apt-get", "-o", "DPkg::Lock::Timeout=600", "install", "-y",
               "--no-install-recommends", package]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900,
                             check=False)
        if out.returncode != 0:  # stale package lists: refresh once, then try again
            subprocess.run(["apt-get", "-o", "DPkg::Lock::Timeout=600", "update"],
                           capture_output=True, env=env, timeout=600, check=False)
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900,
                                 check=False)
    found = shutil.which(binary)
    if not found:
        pytest.fail(f"apt-get install {package} did not provide {binary}: {out.stderr[-500:]}")
    return found


@dataclass
class Received:
    at: float
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Receiver:
    """A local HTTP server that records every POST (and answers ``status``)."""

    status: int = 200
    got: list[Received] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                receiver.got.append(Received(time.time(), self.path,
                                             {k.lower(): v for k, v in self.headers.items()},
                                             body))
                self.send_response(receiver.status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def at(self, path: str) -> list[Received]:
        return [r for r in self.got if r.path == path]


class Alertmanager:
    """Debian's Alertmanager on a free loopback port, clustering off, notifying
    ``webhook`` (firing and resolved) at once: its own word that an alert resolved."""

    def __init__(self, tmp: Path, webhook: str) -> None:
        self.binary = debian_tool("prometheus-alertmanager", "prometheus-alertmanager")
        self.port = free_port()
        self.dir = tmp
        (tmp / "am.yml").write_text(
            "route:\n  receiver: hook\n  group_by: ['incident']\n  group_wait: 0s\n"
            "  group_interval: 1s\n  repeat_interval: 1h\n"
            f"receivers:\n  - name: hook\n    webhook_configs:\n      - url: {webhook}/am\n"
            "        send_resolved: true\n")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Alertmanager:
        self.log = (self.dir / "am.log").open("wb")
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={self.dir / 'am.yml'}",
             f"--storage.path={self.dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address="],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.1)
        raise AssertionError(f"alertmanager did not come up: {(self.dir / 'am.log').read_text()}")

    def alerts(self) -> list[dict[str, Any]]:
        """``GET /api/v2/alerts``: the active alerts (resolved ones are not listed)."""
        with urllib.request.urlopen(f"{self.url}/api/v2/alerts", timeout=5) as r:
            return list(json.loads(r.read()))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
