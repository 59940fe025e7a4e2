"""A switch lost in a 4,096-rank job: anomalies, diagnoses, incidents and pages, and the
time from the loss to its detection and to the remediation decision.

An embedded control plane (nats-server, redis-server) and the real detector, diagnoser,
remediator and bridge (webhook to a local HTTP receiver), with their default settings.
4,096 simulated ranks (512 hosts x 8, each rank's heartbeat at its own phase of the
second, a step report per second) publish over one NATS connection as the client does;
an agent per host says hello (host-0 runs the rendezvous store), beats once a second with
its ranks' process states, and the survivors' agents acknowledge commands. The topology
file puts 32 hosts on each of 16 switches. After a warm-up, switch sw-3 dies: its 32 hosts
(256 ranks) and their agents fall silent at once, and the others stop stepping (they wait
in a collective for the lost ranks).

Two runs, in the same process on the same servers: the baseline with the diagnoser's
``domain_window`` at 0 (every host on its own, as before) and correlation on (the default
window, 2 s). Each run stops ``--observe`` seconds after the loss.

Run: ``.venv/bin/python bench/bench_fleet.py [--out results.json] [--observe 25]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import nats

from trainguard.contract.codec import decode_durable
from trainguard.contract.schemas import (
    Anomaly,
    Attempt,
    Command,
    CommandAck,
    Diagnosis,
    Heartbeat,
    Incident,
    NodeHeartbeat,
    NodeHello,
    RankHello,
    StepReport,
)
from trainguard.contract.subjects import Subjects
from trainguard.runtime.bus import Bus
from trainguard.runtime.config import Settings, load_settings
from trainguard.runtime.embedded import EmbeddedControlPlane
from trainguard.runtime.service import Runtime, Service, run_service
from trainguard.runtime.topology import provision, streams
from trainguard.services.bridge.service import BridgeService
from trainguard.services.bridge.settings import BridgeSettings
from trainguard.services.detector.service import DetectorService
from trainguard.services.detector.settings import DetectorSettings
from trainguard.services.diagnoser.service import DiagnoserService
from trainguard.services.diagnoser.settings import DiagnoserSettings
from trainguard.services.remediator.service import RemediatorService
from trainguard.services.remediator.settings import RemediatorSettings

HOSTS, PER_HOST, PER_SWITCH = 512, 8, 32
LOST_SWITCH = 3
LOST = {f"host-{h}" for h in range(LOST_SWITCH * PER_SWITCH, (LOST_SWITCH + 1) * PER_SWITCH)}
SLOTS = 10
"""Each second is cut in this many slots; rank r beats in slot r % SLOTS."""


def topology() -> str:
    return "".join(f'[[domains]]\nlevel = "switch"\nname = "sw-{s}"\n'
                   f'hosts = ["host-[{s * PER_SWITCH}-{(s + 1) * PER_SWITCH - 1}]"]\n\n'
                   for s in range(HOSTS // PER_SWITCH))


class Pages:
    """The webhook receiver: each POST's arrival and state."""

    def __init__(self) -> None:
        self.got: list[tuple[float, str, str]] = []
        pages = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                pages.got.append((time.time(), self.headers.get("ce-tgstate", ""),
                                  self.headers.get("ce-subject", "")))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@dataclass
class Seen:
    """What came out on the event subjects (arrival times)."""

    anomalies: dict[str, tuple[float, Anomaly]] = field(default_factory=dict)
    diagnoses: dict[str, tuple[float, Diagnosis]] = field(default_factory=dict)
    incidents: dict[str, list[tuple[float, Incident]]] = field(default_factory=dict)


class Fleet:
    """4,096 ranks and 512 agents, simulated."""

    def __init__(self, bus: Bus, job: str) -> None:
        self.bus, self.s, self.job = bus, bus.subjects, job
        self.lost = False
        self.seq = 0
        self.step = 0
        self.started = time.time()

    @staticmethod
    def host(rank: int) -> str:
        return f"host-{rank // PER_HOST}"

    async def hello(self) -> None:
        for h in range(HOSTS):
            await self.bus.publish_durable(self.s.reg_node(self.job, f"host-{h}"), NodeHello(
                job=self.job, host=f"host-{h}", local_ranks=list(range(PER_HOST)),
                nnodes_min=HOSTS // 2, nnodes_max=HOSTS, hosts_store=h == 0, time=time.time()))
        for r in range(HOSTS * PER_HOST):
            await self.bus.publish_durable(self.s.reg_rank(self.job, r), RankHello(
                job=self.job, rank=r, world_size=HOSTS * PER_HOST, local_rank=r % PER_HOST,
                host=self.host(r), pid=100_000 + r, attempt=Attempt(pid=100_000 + r),
                time=time.time()))

    async def acks(self, nc: Any) -> None:
        """The survivors' agents acknowledge every command sent to them."""
        async def cb(msg: Any) -> None:
            cmd = decode_durable(msg.data, Command)
            alive = {f"host-{h}" for h in range(HOSTS)} - LOST
            target = cmd.target.removeprefix("host.")
            for host in sorted(alive if cmd.target == "all" else {target} & alive):
                await self.bus.publish_durable(self.s.ack(self.job, cmd.issuer), CommandAck(
                    command_id=cmd.id, job=self.job, responder=f"host-{host}",
                    outcome="done", kind=cmd.kind))

        await nc.subscribe(self.s.pattern("cmd", job=self.job, tail=">"), cb=cb)

    async def run(self, stop: asyncio.Event) -> None:
        """Beat and step until ``stop``; each rank once a second in its slot."""
        ranks = HOSTS * PER_HOST
        slot = 0
        t0 = time.monotonic()
        while not stop.is_set():
            now = time.time()
            if slot == 0 and not self.lost:
                self.step += 1
            for r in range(slot, ranks, SLOTS):
                host = self.host(r)
                if self.lost and host in LOST:
                    continue
                self.seq += 1
                if not self.lost:
                    await self.bus.publish_telemetry(self.s.step(self.job, r), StepReport(
                        job=self.job, time=now, seq=self.seq, rank=r, step=self.step,
                        duration=1.0, phases={"data": 0.01, "compute": 0.8, "comm": 0.19},
                        loss=2.0, grad_norm=1.0))
                await self.bus.publish_telemetry(self.s.hb(self.job, r), Heartbeat(
                    job=self.job, time=now, seq=self.seq, rank=r, host=host,
                    pid=100_000 + r, step=self.step,
                    phase="comm" if self.lost else "compute", phase_elapsed=0.1))
            for h in range(slot, HOSTS, SLOTS):  # each agent's beat: its ranks running
                host = f"host-{h}"
                if self.lost and host in LOST:
                    continue
                self.seq += 1
                local = range(h * PER_HOST, (h + 1) * PER_HOST)
                await self.bus.publish_telemetry(self.s.node(self.job, host), NodeHeartbeat(
                    job=self.job, time=now, seq=self.seq, host=host,
                    ranks=dict.fromkeys(local, "S"), pids={r: 100_000 + r for r in local}))
            slot = (slot + 1) % SLOTS
            t0 += 1.0 / SLOTS
            await asyncio.sleep(max(0.0, t0 - time.monotonic()))


async def watch(nc: Any, prefix: str, job: str, seen: Seen) -> None:
    s = Subjects(prefix)

    async def on_anomaly(msg: Any) -> None:
        a = decode_durable(msg.data, Anomaly)
        seen.anomalies.setdefault(a.id, (time.time(), a))
        if a.rev > seen.anomalies[a.id][1].rev:
            seen.anomalies[a.id] = (seen.anomalies[a.id][0], a)

    async def on_diagnosis(msg: Any) -> None:
        d = decode_durable(msg.data, Diagnosis)
        seen.diagnoses.setdefault(d.id, (time.time(), d))
        seen.diagnoses[d.id] = (seen.diagnoses[d.id][0], d)

    async def on_incident(msg: Any) -> None:
        inc = decode_durable(msg.data, Incident)
        seen.incidents.setdefault(inc.id, []).append((time.time(), inc))

    await nc.subscribe(s.event(job, "anomaly"), cb=on_anomaly)
    await nc.subscribe(s.event(job, "diagnosis"), cb=on_diagnosis)
    await nc.subscribe(s.event(job, "incident"), cb=on_incident)
    await nc.flush()


@contextlib.asynccontextmanager
async def serving(services: list[Service[Any]]) -> AsyncIterator[list[Runtime]]:
    stop = asyncio.Event()
    runtimes: list[Runtime] = []
    tasks = []
    for svc in services:
        ready: asyncio.Future[Runtime] = asyncio.get_running_loop().create_future()
        tasks.append(asyncio.create_task(run_service(svc, stop, install_signals=False,
                                                     started=ready.set_result)))
        runtimes.append(await asyncio.wait_for(ready, 60))
    for rt in runtimes:  # bound consumers (the bridge takes new events only)
        for _ in range(600):
            if (await rt.ready())[0]:
                break
            await asyncio.sleep(0.05)
    try:
        yield runtimes
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)


async def one_run(plane: EmbeddedControlPlane, tmp: Path, window: float,
                  observe: float, warmup: float) -> dict[str, Any]:
    prefix, job = f"fleet{int(window * 10)}", "llm-4k"
    base = {"nats_url": plane.nats.url, "redis_url": plane.redis.url, "prefix": prefix}
    (tmp / "topology.toml").write_text(topology())
    pages = Pages()
    nc = await nats.connect(plane.nats.url, pending_size=256 * 1024 * 1024)
    await provision(nc.jetstream(), streams(prefix))
    bus = Bus(nc, Subjects(prefix), source="bench")
    fleet = Fleet(bus, job)
    seen = Seen()
    await watch(nc, prefix, job, seen)
    await fleet.acks(nc)

    def settings(cls: type[Settings], **kw: Any) -> Any:
        return load_settings(cls, env={}, overrides={**base, **kw})

    services: list[Service[Any]] = [
        DetectorService(settings(DetectorSettings)),
        DiagnoserService(settings(DiagnoserSettings, domain_window=window,
                                  topology=str(tmp / "topology.toml"))),
        RemediatorService(settings(RemediatorSettings)),
        BridgeService(settings(BridgeSettings, webhook_url=f"{pages.url}/ce")),
    ]
    stop = asyncio.Event()
    try:
        async with serving(services):
            detector = services[0]
            assert isinstance(detector, DetectorService)
            await fleet.hello()
            sim = asyncio.create_task(fleet.run(stop))
            await asyncio.sleep(warmup)  # the detector takes the job and learns its steps
            if job not in detector.owned:
                raise RuntimeError(f"the detector did not take {job} within the warm-up")
            onset = time.time()  # the switch dies: no beat of its ranks from now on
            fleet.lost = True
            await asyncio.sleep(observe)
            stop.set()
            await sim
    finally:
        pages.server.shutdown()
        await nc.close()
    return summarize(seen, pages, onset, window)


def summarize(seen: Seen, pages: Pages, onset: float, window: float) -> dict[str, Any]:
    lost_ranks = {r for r in range(HOSTS * PER_HOST) if Fleet.host(r) in LOST}
    anomalies = [(t, a) for t, a in seen.anomalies.values() if t >= onset]
    named: set[int] = set()
    all_named = None
    for t, a in sorted(anomalies, key=lambda x: x[0]):
        named |= set(a.ranks) & lost_ranks
        if named == lost_ranks and all_named is None:
            all_named = t - onset
    decisions = sorted(t for revs in seen.incidents.values() for t, inc in revs
                       if inc.actions and t >= onset)
    first_plan = {i: min(t for t, inc in revs if inc.actions)
                  for i, revs in seen.incidents.items() if any(inc.actions for _, inc in revs)}
    last = {i: max(revs, key=lambda x: x[1].rev)[1] for i, revs in seen.incidents.items()}
    firing = [p for p in pages.got if p[1] == "firing"]

    def done(action: str) -> float | None:
        """When a revision first showed an ``action`` step done (from the loss)."""
        times = [t for revs in seen.incidents.values() for t, inc in revs
                 if any(s.action == action and s.status == "done" for s in inc.actions)]
        return round(min(times) - onset, 2) if times else None

    return {
        "domain_window_s": window,
        "ranks": HOSTS * PER_HOST, "hosts": HOSTS, "lost_hosts": len(LOST),
        "lost_ranks": len(lost_ranks),
        "anomalies": len(anomalies),
        "anomaly_kinds": sorted({a.kind for _, a in anomalies}),
        "diagnoses": len(seen.diagnoses),
        "diagnosis_causes": sorted({d.cause for _, d in seen.diagnoses.values()}),
        "incidents": len(seen.incidents),
        "incident_causes": sorted({i.cause for i in last.values()}),
        "domains": sorted({i.domain for i in last.values() if i.domain}),
        "pages": len(firing),
        "detection_s": round(min(t for t, _ in anomalies) - onset, 2) if anomalies else None,
        "all_lost_ranks_named_s": round(all_named, 2) if all_named is not None else None,
        "first_decision_s": round(decisions[0] - onset, 2) if decisions else None,
        "last_incident_decided_s": (round(max(first_plan.values()) - onset, 2)
                                    if first_plan else None),
        "isolated_s": done("isolate"),
        "restarted_s": done("restart"),
        "plans": sorted({" -> ".join(s.action for s in i.actions) for i in last.values()}),
        "isolated_in_one_step": max((len(s.params.get("hosts", [])) for i in last.values()
                                     for s in i.actions if s.action == "isolate"), default=0),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--observe", type=float, default=25.0,
                    help="seconds each run goes on after the loss")
    ap.add_argument("--warmup", type=float, default=8.0)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        plane = EmbeddedControlPlane(Path(tmp) / "plane").start()
        try:
            for window in (0.0, DiagnoserSettings.domain_window):
                results.append(asyncio.run(one_run(plane, Path(tmp), window, args.observe,
                                                   args.warmup)))
        finally:
            plane.stop()
    rows = [("anomalies", "anomalies"), ("diagnoses", "diagnoses"),
            ("incidents", "incidents"), ("pages (webhook, firing)", "pages"),
            ("onset -> first anomaly (s)", "detection_s"),
            ("onset -> all 256 lost ranks named (s)", "all_lost_ranks_named_s"),
            ("onset -> first decision (s)", "first_decision_s"),
            ("onset -> last incident decided (s)", "last_incident_decided_s"),
            ("hosts isolated in one step", "isolated_in_one_step"),
            ("onset -> isolation done (s)", "isolated_s"),
            ("onset -> restart acknowledged (s)", "restarted_s")]
    print("| switch lost, 4,096 ranks (32 of 512 hosts) | baseline: window 0 | "
          f"correlated: window {results[1]['domain_window_s']:g} s |\n| --- | --- | --- |")
    for label, key in rows:
        print(f"| {label} | {results[0][key]} | {results[1][key]} |")
    for r in results:
        print(f"window {r['domain_window_s']:g}: causes {r['incident_causes']}, domains "
              f"{r['domains']}, plans {r['plans']}, anomaly kinds {r['anomaly_kinds']}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
