"""``trainguard up`` as a user runs it: a subprocess that comes up, answers, and stops."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from trainguard.runtime.embedded import free_port
from trainguard.runtime.ports import OFFSETS, PLUGIN_OFFSET


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True, check=False).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def _trainguard(*args: str) -> list[str]:
    return [sys.executable, "-m", "trainguard", *args]


def _free_block(host: str = "127.0.0.1") -> int:
    """A base port whose service ports (base+1 .. base+PLUGIN_OFFSET+3) are free now."""
    for _ in range(200):
        base = random.randrange(20000, 60000)
        held = []
        try:
            for port in range(base + 1, base + PLUGIN_OFFSET + 4):
                s = socket.socket()
                held.append(s)
                s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise AssertionError("no free block of ports")


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except urllib.error.URLError as exc:  # not listening yet: services start after "running"
        return 0, str(exc)


@pytest.mark.parametrize(("secure", "auth"), [(True, "static"), (True, "jwt"),
                                              (False, "static")],
                         ids=["auth", "auth-jwt", "insecure"])
def test_up_starts_embedded_servers_answers_and_stops_cleanly(tmp_path: Path, secure: bool,
                                                              auth: str) -> None:
    """Also with ``TRAINGUARD_LOG_FORMAT=json``: its log lines are JSON objects. With auth
    (the default) every service connects as its own role and anonymous clients are refused;
    in ``jwt`` mode each with its own ``.creds`` to a server in operator mode.
    Each service's health server is on its fixed port (base + offset) and bind address
    (127.0.0.2 here: another loopback address than the default proves the option), and
    ``/readyz?verbose`` lists every check."""
    nats_port, redis_port = free_port(), free_port()
    host = "127.0.0.2"
    base = _free_block(host)
    proc = subprocess.Popen(
        _trainguard("up", "--nats-port", str(nats_port), "--redis-port", str(redis_port),
                    "--data-dir", str(tmp_path), "--base-port", str(base),
                    "--health-host", host, "--auth", auth,
                    *(() if secure else ("--insecure",))),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        # With a sink the bridge runs (as the plugin `service` role under auth); without, skipped.
        env={**os.environ, "TRAINGUARD_LOG_FORMAT": "json",
             **({"TRAINGUARD_WEBHOOK_URL": "http://127.0.0.1:9/hook"} if secure else {})})
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "trainguard up: running" in line:
                break
        text = "".join(lines)
        assert f"nats:  nats://127.0.0.1:{nats_port}" in text, text
        assert f"redis: redis://127.0.0.1:{redis_port}/0" in text, text
        children = _children(proc.pid)
        assert len(children) >= 2
        with socket.create_connection(("127.0.0.1", nats_port), timeout=2) as s:
            assert s.recv(4) == b"INFO"
        with socket.create_connection(("127.0.0.1", redis_port), timeout=2) as s:
            s.sendall(b"PING\r\n")
            assert s.recv(7) == (b"-NOAUTH" if secure else b"+PONG\r\n")
        assert (f"creds: {tmp_path.resolve() / 'creds'}" in text) == secure, text
        assert ("(jwt:" in text) == (auth == "jwt"), text
        if auth == "jwt":  # operator mode: a password user is no user at all
            assert "operator:" in (tmp_path / "nats" / "nats-server.auth").read_text()
            assert (tmp_path / "creds" / "detector.creds").is_file()
            deadline = time.monotonic() + 30
            while "issuer: ready" not in text:  # agents' source of their ranks' credentials
                assert time.monotonic() < deadline and proc.poll() is None, text
                text += proc.stdout.readline()
        assert ("bridge: skipped (no sink configured" in text) != secure, text
        for name in ("detector", "diagnoser", "remediator", "checkpointer",
                     *(("bridge",) if secure else ())):
            url = f"http://{host}:{base + OFFSETS[name]}"
            deadline = time.monotonic() + 60
            while (got := _get(f"{url}/readyz?verbose"))[0] != 200:
                assert time.monotonic() < deadline, got
                time.sleep(0.2)
            lines = got[1].splitlines()
            assert lines[:3] == ["[+] nats: connected", lines[1], "[+] redis: answers"], got
            assert lines[1].startswith("[+] consumers: bound: "), got
            assert lines[3].startswith(f"[+] {name}: ") and lines[-1] == "readyz check passed"
            code, metrics = _get(f"{url}/metrics")
            assert code == 200 and f'service="{name}"' in metrics
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0
        assert not any(_alive(c) for c in children)
        logged = [json.loads(line) for line in (text + rest).splitlines()
                  if line.startswith("{")]
        ready = [r for r in logged if r["logger"] == "trainguard.runtime.service"
                 and r["message"].startswith("service detector ready")]
        assert ready and ready[0]["level"] == "INFO" and ready[0]["time"].endswith("Z"), rest
        for name in ("detector", "diagnoser", "remediator", "checkpointer"):
            assert f"{name}: ready" in text + rest, text + rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def test_up_refuses_a_taken_health_port(tmp_path: Path) -> None:
    base = _free_block()
    with socket.socket() as held:
        held.bind(("127.0.0.1", base + OFFSETS["remediator"]))
        held.listen()
        out = subprocess.run(_trainguard("up", "--nats-port", str(free_port()), "--redis-port",
                                         str(free_port()), "--data-dir", str(tmp_path),
                                         "--base-port", str(base)),
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    assert (f"health port {base + 3} of remediator (base port {base} + 3) is already in use"
            in out.stderr), out.stderr


def test_up_refuses_a_taken_port(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        out = subprocess.run(_trainguard("up", "--nats-port", str(port), "--redis-port",
                                         str(free_port()), "--data-dir", str(tmp_path),
                                         "--base-port", "0"),
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert f"port {port} on 127.0.0.1 is already in use" in out.stderr


@pytest.mark.parametrize(("args", "message"), [
    (("service", "nonexistent"), "unknown service 'nonexistent'"),
    (("service", "bridge"), "service bridge: no sink configured: set TRAINGUARD_ALERTMANAGER_URL"),
    (("up", "--nats", "localhost:4222"), "is not a valid URL"),
    (("up", "--redis", "http://x"), "redis_url='http://x' is not a valid URL"),
    (("up", "--nats-port", "70000"), "use a TCP port between 1 and 65535"),
    (("up", "--auth", "jwt", "--insecure"), "auth_mode=jwt (--auth jwt"),
])
def test_bad_arguments_say_what_is_wrong(args: tuple[str, ...], message: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.endswith("_URL")
           or not k.startswith("TRAINGUARD_")}
    out = subprocess.run(_trainguard(*args), capture_output=True, text=True, timeout=60,
                         env=env)
    assert out.returncode == 2, out
    assert message in out.stderr


