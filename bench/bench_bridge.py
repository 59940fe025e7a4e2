"""Paging delay: an incident event on the bus to the webhook receiver, through the bridge.

An embedded control plane, the bridge (webhook + Slack sinks pointed at a local HTTP
receiver) and a publisher of incident revisions: each new incident opens (one page per
sink) and then resolves (one more). The delay is the receiver's arrival time minus the
publish time. The baseline, measured in the same run against the same receiver, is a bare
``urllib`` POST from this process: the HTTP leg alone, without the bus, JetStream's
durable consumer, the Redis dedupe record or the thread hop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import nats

from trainguard.contract.schemas import Incident
from trainguard.contract.subjects import Subjects
from trainguard.runtime.bus import Bus
from trainguard.runtime.config import load_settings
from trainguard.runtime.embedded import EmbeddedControlPlane
from trainguard.runtime.service import Runtime, run_service
from trainguard.runtime.topology import provision, streams
from trainguard.services.bridge.service import BridgeService
from trainguard.services.bridge.settings import BridgeSettings

PREFIX = "bench"


class Receiver:
    def __init__(self) -> None:
        self.arrivals: dict[str, float] = {}
        self.waiters: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Event]] = {}
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                key = self.headers.get("ce-id") or f"slack:{time.time_ns()}"
                path = f"{self.path}:{key}"
                receiver.arrivals.setdefault(path, time.time())
                if path in receiver.waiters:
                    loop, event = receiver.waiters[path]
                    loop.call_soon_threadsafe(event.set)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


def quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median_ms": statistics.median(ordered) * 1000,
            "p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000,
            "max_ms": ordered[-1] * 1000}


def baseline(url: str, n: int) -> list[float]:
    out = []
    for i in range(n):
        req = urllib.request.Request(f"{url}/base", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json",
                                              "ce-id": f"b{i}"})
        t0 = time.time()
        with urllib.request.urlopen(req, timeout=5) as r:
            r.read()
        out.append(time.time() - t0)
    return out


async def through_bridge(plane: EmbeddedControlPlane, receiver: Receiver,
                         n: int) -> list[float]:
    policy = Path(tempfile.mkdtemp()) / "policy.toml"
    policy.write_text("[notify]\nrate_limit = 0\n")  # every page measured, none held back
    settings = load_settings(BridgeSettings, env={}, overrides={
        "nats_url": plane.nats.url, "redis_url": plane.redis.url, "prefix": PREFIX,
        "policy": str(policy),
        "webhook_url": f"{receiver.url}/ce", "slack_webhook_url": f"{receiver.url}/slack"})
    nc = await nats.connect(plane.nats.url)
    await provision(nc.jetstream(), streams(PREFIX))
    bus = Bus(nc, Subjects(PREFIX), source="bench")
    stop = asyncio.Event()
    ready = asyncio.Event()
    runtimes: list[Runtime] = []

    def started(rt: Runtime) -> None:
        runtimes.append(rt)
        ready.set()

    task = asyncio.create_task(run_service(BridgeService(settings), stop, install_signals=False,
                                           started=started))
    await asyncio.wait_for(ready.wait(), 30)
    for _ in range(600):  # up to 30 s: the consumer takes new events only, so bind it first
        if (await runtimes[0].ready())[0]:
            break
        await asyncio.sleep(0.05)
    delays: list[float] = []
    subject = Subjects(PREFIX).event("bench-job", "incident")
    try:
        for i in range(-1, n):  # incident -1 warms the consumer up: not measured
            now = time.time()
            for rev, status in ((1, "open"), (2, "resolved")):
                inc = Incident(id=f"inc-{i}", job="bench-job", cause="rank_hang",
                               status=status, rev=rev, ranks=[1], hosts=["node-a"],  # type: ignore[arg-type]
                               onset_at=now - 5, detected_at=now,
                               resolved_at=now if status == "resolved" else None)
                key = f"/ce:inc-{i}.{rev}"
                arrived = asyncio.Event()
                receiver.waiters[key] = (asyncio.get_running_loop(), arrived)
                t0 = time.time()
                await bus.publish_durable(subject, inc)
                await asyncio.wait_for(arrived.wait(), 30)
                if i >= 0:
                    delays.append(receiver.arrivals[key] - t0)
    finally:
        stop.set()
        await task
        await nc.close()
    return delays


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--incidents", type=int, default=50)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    receiver = Receiver()
    with tempfile.TemporaryDirectory() as tmp:
        plane = EmbeddedControlPlane(Path(tmp))
        plane.start()
        try:
            base = baseline(receiver.url, args.incidents * 2)
            bridge = asyncio.run(through_bridge(plane, receiver, args.incidents))
        finally:
            plane.stop()
            receiver.server.shutdown()
    result = {"revisions": len(bridge), "bridge_event_to_webhook": quantiles(bridge),
              "baseline_direct_post": quantiles(base)}
    print("| measure | median | p99 | max |\n| --- | --- | --- | --- |")
    for name, q in (("event → webhook receiver, through the bridge", result[
            "bridge_event_to_webhook"]), ("baseline: a direct POST to the receiver",
                                          result["baseline_direct_post"])):
        assert isinstance(q, dict)
        print(f"| {name} | {q['median_ms']:.1f} ms | {q['p99_ms']:.1f} ms | "
              f"{q['max_ms']:.1f} ms |")
    if args.out:
        Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
