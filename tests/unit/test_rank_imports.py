"""What a rank pays before its first step: no service stack, no DCP until it is needed, a
bounded resume lookup, and nothing at all when trainguard is disabled."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainguard import Guard
from trainguard.contract.schemas import ResumePoint
from trainguard.runtime.embedded import free_port

HEAVY = ("opentelemetry.sdk", "prometheus_client", "redis", "rich", "trainguard.services",
         "trainguard.runtime", "trainguard.analysis", "trainguard.agent")
"""The control plane's stack: none of it belongs on the rank path."""

# A first step of a Guard, after its transport thread has tried the bus once (so whatever it
# imports on that thread is loaded too). The URL is dead: the test needs no server.
FIRST_STEP = """
import time, trainguard
guard = trainguard.Guard(job="imports", rank=0, world_size=1, host="h",
                         nats_url="nats://127.0.0.1:{port}", heartbeat_interval=60)
with guard.step(0) as s:
    with s.phase("compute"):
        pass
deadline = time.monotonic() + 60
while guard.enabled and not guard.transport.stats.connect_failures \\
        and time.monotonic() < deadline:
    time.sleep(0.01)
"""


def _modules_after(code: str, **env: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\n"
                          "print('\\n'.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True, timeout=120,
                         env={**os.environ, **env})
    return set(out.stdout.split())


def _heavy(loaded: set[str]) -> set[str]:
    return {m for m in loaded if m.startswith(HEAVY)}


def test_the_rank_path_loads_no_service_stack() -> None:
    loaded = _modules_after("import trainguard")
    assert not _heavy(loaded)
    assert "torch" not in loaded
    # nats-py loads on the Guard's own thread, while the process group forms.
    assert not {m for m in loaded if m == "nats" or m.startswith("nats.")}


def test_a_guard_and_its_first_step_load_no_service_stack() -> None:
    loaded = _modules_after(FIRST_STEP.format(port=free_port()),
                            TRAINGUARD_DISABLED="0")
    assert "nats.aio.client" in loaded  # the transport did run
    assert not _heavy(loaded)


def test_a_disabled_guard_loads_no_bus_client_and_starts_no_thread() -> None:
    code = FIRST_STEP.format(port=free_port()) + (
        "import threading\nassert threading.active_count() == 1, threading.enumerate()\n")
    loaded = _modules_after(code, TRAINGUARD_DISABLED="1")
    assert not {m for m in loaded if m == "nats" or m.startswith("nats.")}
    assert not _heavy(loaded)


def test_trainguard_torch_defers_distributed_checkpoint() -> None:
    loaded = _modules_after("import torch, trainguard.torch")
    assert "torch.distributed.checkpoint.state_dict_saver" not in loaded
    assert "torch.distributed.checkpoint.default_planner" not in loaded


def test_a_checkpointer_imports_dcp_in_the_background() -> None:
    loaded = _modules_after(
        "from trainguard.torch.checkpoint import warm_up\n"
        "warm_up().join(120)")
    assert "torch.distributed.checkpoint.state_dict_saver" in loaded


# -- the resume lookup is bounded ------------------------------------------------------------

@pytest.fixture
def frozen_server() -> Iterator[int]:
    """A port that accepts TCP connections and never says anything: a frozen NATS server
    (the client's connect waits for an INFO line that never comes)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    conns: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not done.is_set():
            try:
                conns.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1]
    finally:
        done.set()
        t.join(5)
        for c in conns:
            c.close()
        srv.close()


def _latest(root: Path, job: str, step: int) -> ResumePoint:
    from trainguard.contract.codec import encode_durable

    point = ResumePoint(job=job, step=step, path=str(root / job / f"step-{step}"),
                        checkpoint_id="c1")
    (root / job).mkdir(parents=True)
    (root / job / "LATEST").write_bytes(encode_durable(point))
    return point


@pytest.mark.parametrize("bus", ["down", "frozen"])
def test_resume_lookup_is_bounded_when_the_bus_is_down_or_frozen(
        bus: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    port = free_port() if bus == "down" else request.getfixturevalue("frozen_server")
    point = _latest(tmp_path, "resume", 40)
    guard = Guard(job="resume", rank=0, world_size=1, host="h",
                  nats_url=f"nats://127.0.0.1:{port}", heartbeat_interval=60,
                  enabled=True)
    try:
        t0 = time.monotonic()
        got = guard.resume_point(root=str(tmp_path))
        took = time.monotonic() - t0
    finally:
        guard.close(timeout=0.5)
    assert got is not None and got.step == point.step  # LATEST answered
    # The bound is 0.5 s; the old lookup waited 2 s for a connection. Generous for a
    # busy machine, still below what an unbounded wait costs.
    assert took < 1.5, took


CHECKPOINTER = """
import os, sys, threading, time
import torch, torch.distributed as dist
import trainguard, trainguard.torch as tgt
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}", RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
guard = trainguard.Guard(job="imports", host="h", nats_url="nats://127.0.0.1:{dead}",
                         heartbeat_interval=60)
ckpt = tgt.Checkpointer(guard, root="{root}")
assert ckpt.resume_point() is None
SAVER = "torch.distributed.checkpoint.state_dict_saver"
with guard.step(0):
    pass
print("before-first-step-done", SAVER in sys.modules)
with guard.step(1):
    pass
deadline = time.monotonic() + 120
while SAVER not in sys.modules and time.monotonic() < deadline:
    time.sleep(0.02)
print("after-first-step", SAVER in sys.modules)
guard.close()
dist.destroy_process_group()
"""


@pytest.mark.parametrize("disabled", ["0", "1"])
def test_a_checkpointer_imports_dcp_only_after_the_first_step(disabled: str,
                                                             tmp_path: Path) -> None:
    code = CHECKPOINTER.format(port=free_port(), dead=free_port(), root=tmp_path)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=180, env={**os.environ, "GLOO_SOCKET_IFNAME": "lo",
                                           "TRAINGUARD_DISABLED": disabled})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "before-first-step-done False" in out.stdout
    assert "after-first-step True" in out.stdout
