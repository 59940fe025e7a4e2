"""A real headless Chromium, driven through chromedriver's W3C WebDriver HTTP API with the
standard library only (no selenium needed).

:func:`ensure_chromium` installs Debian's ``chromium`` and ``chromium-driver`` with apt
when they are missing (idempotent: apt does nothing when they are there); the caller skips
only where installing is impossible (not root, no apt).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from trainguard.runtime.embedded import free_port

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--force-device-scale-factor=1"]


def ensure_chromium() -> str | None:
    """The chromedriver path once both packages are installed, or why they cannot be."""
    if shutil.which("chromedriver") and Path(CHROMIUM).exists():
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "chromium/chromium-driver missing and apt-get as root is not available"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    out = subprocess.run(["apt-get", "install", "-y", "-q", "chromium", "chromium-driver"],
                         capture_output=True, text=True, env=env, timeout=900)
    if out.returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, timeout=600)
        out = subprocess.run(["apt-get", "install", "-y", "-q", "chromium", "chromium-driver"],
                             capture_output=True, text=True, env=env, timeout=900)
    if out.returncode != 0 or not shutil.which("chromedriver"):
        return f"apt-get install chromium chromium-driver failed: {out.stderr[-500:]}"
    return None


class Browser:
    """One chromedriver process and one session of a fresh headless Chromium profile."""

    def __init__(self, width: int = 1440, height: int = 900) -> None:
        self.port = free_port()
        self.profile = tempfile.mkdtemp(prefix="tg-chromium-")
        self.proc = subprocess.Popen(["chromedriver", f"--port={self.port}"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.base = f"http://127.0.0.1:{self.port}"
        self._wait_ready()
        caps = {"capabilities": {"alwaysMatch": {"browserName": "chrome",
                "goog:chromeOptions": {"binary": CHROMIUM, "args": [
                    *FLAGS, f"--user-data-dir={self.profile}",
                    f"--window-size={width},{height}"]}}}}
        self.session = self._call("POST", "/session", caps)["sessionId"]

    def _wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self._call("GET", "/status").get("ready"):
                    return
            except (urllib.error.URLError, ConnectionError):
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError("chromedriver did not become ready")
            time.sleep(0.1)

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return json.loads(resp.read())["value"]
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"webdriver {method} {path}: {exc.read()[:500]!r}") from None

    def get(self, url: str) -> None:
        self._call("POST", f"/session/{self.session}/url", {"url": url})

    def run(self, script: str, *args: Any) -> Any:
        """Run ``script`` (a function body) in the page and return its value."""
        return self._call("POST", f"/session/{self.session}/execute/sync",
                          {"script": script, "args": list(args)})

    def script_timeout(self, seconds: float) -> None:
        """How long :meth:`run` may wait for a script's promise (WebDriver's default: 30 s)."""
        self._call("POST", f"/session/{self.session}/timeouts", {"script": int(seconds * 1000)})

    def screenshot(self, path: Path) -> None:
        png = base64.b64decode(self._call("GET", f"/session/{self.session}/screenshot"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(png)

    def close(self) -> None:
        with contextlib.suppress(Exception):  # closing anyway
            self._call("DELETE", f"/session/{self.session}")
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.profile, ignore_errors=True)
