"""End-to-end helpers: real torchrun jobs (gloo on CPU), loopback only."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from trainguard.runtime.embedded import free_port

E2E_TIMEOUT = 180


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)
            item.add_marker(pytest.mark.timeout(E2E_TIMEOUT))


def job_env(nats_url: str, prefix: str, **extra: str) -> dict[str, str]:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "TRAINGUARD_NATS_URL": nats_url,
           "TRAINGUARD_PREFIX": prefix, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           **extra}
    env.pop("TRAINGUARD_DISABLED", None)
    return env


def torchrun(nproc: int, args: Sequence[str], env: dict[str, str], log: Path,
             module: str = "trainguard.examples.toy_trainer") -> subprocess.Popen[bytes]:
    """A single-node torchrun job on loopback; output goes to ``log``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
           "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "--local-addr", "127.0.0.1",
           "-m", module, *args]
    with open(log, "wb") as fh:
        return subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test started. At the end each still running gets SIGTERM, so the
    launcher stops the ranks it spawned (torch puts them in sessions of their own, out of
    reach of the launcher's process group), then SIGKILL for its whole group."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        if p.poll() is None:
            p.wait(10)


def launch(job: str, host: str, env: dict[str, str], log: Path, *, nproc: int = 2,
           trainer: Sequence[str] = (), launch_opts: Sequence[str] = (),
           torchrun_opts: Sequence[str] = (),
           module: str = "trainguard.examples.toy_trainer") -> subprocess.Popen[bytes]:
    """``trainguard launch`` of the toy trainer (or ``module``), as a user would run it."""
    cmd = [sys.executable, "-m", "trainguard", "launch", "--job", job, "--host", host,
           "--preempt-grace", "3", *launch_opts, "--nproc-per-node", str(nproc),
           "--local-addr", "127.0.0.1",
           *torchrun_opts, "-m", "--", module, "--job", job, *trainer]
    with open(log, "wb") as fh:
        return subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
