"""The dashboard's HTTP side and its two ways to run, without a browser (the Chromium test
is tests/e2e/test_dashboard.py): ``trainguard dashboard`` on its own, and inside
``trainguard up`` with auth on, where it reads the ranks' telemetry as the on-call role."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import nats

from tests.conftest import wait_until
from trainguard.contract.codec import encode_telemetry
from trainguard.contract.schemas import Heartbeat, StepReport
from trainguard.contract.subjects import Subjects
from trainguard.core.auth import access_from
from trainguard.core.connection import flush
from trainguard.runtime.embedded import free_port


def http(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


def first_event(url: str) -> dict[str, Any]:
    """The first ``summary`` event of the SSE stream."""
    with urllib.request.urlopen(url, timeout=30) as resp:
        assert resp.headers["Content-Type"] == "text/event-stream"
        event = ""
        for raw in resp:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: ") and event == "summary":
                data: dict[str, Any] = json.loads(line[6:])
                return data
    raise AssertionError("the stream ended without a summary event")


async def publish_rank(nc: Any, prefix: str, job: str, rank: int) -> None:
    s, now = Subjects(prefix), time.time()
    await nc.publish(s.hb(job, rank), encode_telemetry(Heartbeat(
        job=job, rank=rank, time=now, host="node-a", step=3, phase="compute",
        phase_elapsed=0.1)))
    await nc.publish(s.step(job, rank), encode_telemetry(StepReport(
        job=job, rank=rank, step=3, time=now, duration=0.2, phases={"compute": 0.15})))
    await flush(nc)


async def ranks_shown(base: str, job: str) -> list[int] | None:
    _, _, body = await asyncio.to_thread(http, base + "api/state")
    jobs = {j["job"]: j for j in json.loads(body)["jobs"]}
    return [r["rank"] for r in jobs[job]["ranks"]] if job in jobs else None


async def read_line_with(proc: asyncio.subprocess.Process, needle: str) -> str:
    assert proc.stdout is not None
    while True:
        line = (await asyncio.wait_for(proc.stdout.readline(), 90)).decode()
        assert line, f"exited before printing {needle!r}"
        if needle in line:
            return line


async def test_trainguard_dashboard_serves_page_state_and_stream(
        nats_url: str, prefix: str, job: str, nc: Any) -> None:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trainguard", "dashboard", "--port", str(port), "--job", job,
        "--nats", nats_url, "--prefix", prefix, stdout=asyncio.subprocess.PIPE)
    try:
        line = await read_line_with(proc, "dashboard: ")
        base = f"http://127.0.0.1:{port}/"
        assert base in line
        status, ctype, body = await asyncio.to_thread(http, base)
        assert (status, ctype) == (200, "text/html; charset=utf-8")
        assert b"new EventSource" in body
        assert (await asyncio.to_thread(http, base + "nope"))[0] == 404

        async def shown() -> bool:
            await publish_rank(nc, prefix, job, 0)  # core telemetry: resent until heard
            return await ranks_shown(base, job) == [0]

        await wait_until(shown, timeout=30, interval=0.3, what="rank 0 on the board")
        await publish_rank(nc, prefix, job + "-other", 0)  # not this dashboard's job
        state = await asyncio.to_thread(first_event, base + "events")
        assert [j["job"] for j in state["jobs"]] == [job]
        assert state["jobs"][0]["top"][0]["phase"] == "compute"
        assert state["jobs"][0]["groups"][0]["group"] == "node-a"
        _, _, body = await asyncio.to_thread(http, base + "api/summary")
        assert json.loads(body)["jobs"][0]["world"] == 1
        status, _, body = await asyncio.to_thread(http, base + f"api/cells?job={job}")
        assert status == 200 and len(json.loads(body)["codes"]) == 1
        assert (await asyncio.to_thread(http, base + "api/cells?job=nope"))[0] == 404
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0


async def test_up_serves_the_dashboard_as_the_oncall_role(tmp_path: Path, job: str) -> None:
    nats_port, redis_port, port = free_port(), free_port(), free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trainguard", "up", "--nats-port", str(nats_port),
        "--redis-port", str(redis_port), "--data-dir", str(tmp_path), "--services", "none",
        "--dashboard-port", str(port), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = await read_line_with(proc, "dashboard: ")
        assert f"http://127.0.0.1:{port}/" in line, line
        rank = access_from(str(tmp_path / "creds" / "rank.json")).nats_options()
        client = await nats.connect(f"nats://127.0.0.1:{nats_port}", **rank)
        base = f"http://127.0.0.1:{port}/"
        try:
            async def shown() -> bool:
                for r in (0, 1):
                    await publish_rank(client, "tg", job, r)
                return await ranks_shown(base, job) == [0, 1]

            await wait_until(shown, timeout=30, interval=0.3, what="both ranks on the board")
        finally:
            await client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 60)


def test_a_taken_dashboard_port_stops_nothing_else(tmp_path: Path) -> None:
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainguard", "up", "--nats-port", str(free_port()),
             "--redis-port", str(free_port()), "--data-dir", str(tmp_path), "--services",
             "none", "--insecure", "--dashboard-port", str(port)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        try:
            seen = []
            for line in proc.stdout:
                seen.append(line)
                if line.startswith("dashboard:"):
                    break
            assert any(x.startswith("dashboard: not started") for x in seen), seen
            assert proc.poll() is None  # the control plane runs on
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
            proc.stdout.close()
