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

The fan-out of the one decision that reaches every surviving host (the group's restart,
to ``cmd.all``): when the remediator issued it, when each agent's ack reached the
remediator's ack box and when the remediator had them all (:func:`timed`). The agents
answer at once and independently (one task each). ``--acks old,new`` runs the ack box as
it was (:class:`LegacyAckBox`: every ack woke the sender to scan every ack again) beside
the current one, on the same servers (the old runs also read the job's node records a
``GET`` a host, as the view did: :func:`legacy_nodes`).
``--hosts 2048`` makes it a 16,384-rank job (2,048 agents); ``--beat-every S`` spaces the
ranks' heartbeats and step reports (the agents still beat every second), keep it under
the detector's 5 s heartbeat timeout.

``--scenario decision`` is that decision alone at any size: the remediator only, every
agent's hello, and one ``network`` diagnosis published as the diagnoser would (the
policy's plan: restart the group), no rank telemetry; it is what runs at 2,048 agents on a
small machine, where 16,384 simulated ranks' telemetry stalls the embedded NATS server.

Run: ``.venv/bin/python bench/bench_fleet.py [--out results.json] [--observe 25]``;
2,048 agents: ``--scenario decision --hosts 2048 --acks old,new --repeat 3``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import nats

from trainguard.contract.codec import decode_durable
from trainguard.contract.envelope import uuid7
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
from trainguard.runtime.state import NodeRecord, decode_node_record
from trainguard.runtime.topology import provision, streams
from trainguard.services.bridge.service import BridgeService
from trainguard.services.bridge.settings import BridgeSettings
from trainguard.services.detector.service import DetectorService
from trainguard.services.detector.settings import DetectorSettings
from trainguard.services.diagnoser.service import DiagnoserService
from trainguard.services.diagnoser.settings import DiagnoserSettings
from trainguard.services.remediator.acks import KEEP_S, MAX_COMMANDS, AckBox
from trainguard.services.remediator.engine import acks_complete
from trainguard.services.remediator.service import RemediatorService
from trainguard.services.remediator.settings import RemediatorSettings
from trainguard.services.remediator.store import Store

LOST_SWITCH = 3
SLOTS = 10
"""Each beat period is cut in this many slots; rank r beats in slot r % SLOTS."""


@dataclass(frozen=True)
class Shape:
    """The simulated job: hosts, ranks per host, hosts per switch, the ranks' beat."""

    hosts: int = 512
    per_host: int = 8
    per_switch: int = 32
    beat_every: float = 1.0
    """Seconds between a rank's heartbeats (and step reports)."""

    @property
    def ranks(self) -> int:
        return self.hosts * self.per_host

    @property
    def lost(self) -> frozenset[str]:
        """The hosts of switch ``sw-<LOST_SWITCH>``."""
        return frozenset(f"host-{h}" for h in range(LOST_SWITCH * self.per_switch,
                                                    (LOST_SWITCH + 1) * self.per_switch))

    def host(self, rank: int) -> str:
        return f"host-{rank // self.per_host}"


def topology(shape: Shape) -> str:
    per = shape.per_switch
    return "".join(f'[[domains]]\nlevel = "switch"\nname = "sw-{s}"\n'
                   f'hosts = ["host-[{s * per}-{(s + 1) * per - 1}]"]\n\n'
                   for s in range(shape.hosts // per))


class LegacyAckBox:
    """The ack box as it was, the baseline: each ack woke the sender, which scanned every
    ack of the command again (:func:`acks_complete`), and each ack copied the list of kept
    command ids to prune it."""

    def __init__(self, *, keep_s: float = KEEP_S, max_commands: int = MAX_COMMANDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._acks: collections.OrderedDict[str, list[CommandAck]] = collections.OrderedDict()
        self._first: dict[str, float] = {}
        self._events: dict[str, asyncio.Event] = {}
        self.keep_s, self.max_commands, self._clock = keep_s, max_commands, clock

    def add(self, ack: CommandAck) -> None:
        ident = ack.command_id
        if ident not in self._acks:
            self._first[ident] = self._clock()
        self._acks.setdefault(ident, []).append(ack)
        self._prune()
        event = self._events.get(ident)
        if event is not None:
            event.set()

    def __len__(self) -> int:
        return len(self._acks)

    def _prune(self) -> None:
        now = self._clock()
        for ident in list(self._acks):
            over = len(self._acks) > self.max_commands
            if not over and now - self._first[ident] <= self.keep_s:
                break
            if ident not in self._events:
                del self._acks[ident]
                del self._first[ident]

    async def collect(self, ident: str, hosts: Collection[str],
                      timeout: float) -> list[CommandAck]:
        deadline = time.monotonic() + timeout
        event = self._events[ident] = asyncio.Event()
        try:
            while not acks_complete(self._acks.get(ident, []), hosts):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                event.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), remaining)
        finally:
            self._events.pop(ident, None)
        self._first.pop(ident, None)
        return self._acks.pop(ident, [])


@dataclass
class Collected:
    """One command's acks as the remediator's box saw them (wall-clock times)."""

    arrived: list[float] = field(default_factory=list)
    awaited: int = 0
    started: float = 0.0
    ended: float = 0.0
    got: int = 0


def timed(box: type[Any]) -> type[Any]:
    """``box`` recording when each ack reached it and when its sender had them."""

    class Timed(box):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.seen: dict[str, Collected] = collections.defaultdict(Collected)

        def add(self, ack: CommandAck) -> None:
            self.seen[ack.command_id].arrived.append(time.time())
            super().add(ack)

        async def collect(self, ident: str, hosts: Collection[str],
                          timeout: float) -> list[CommandAck]:
            seen = self.seen[ident]
            seen.started, seen.awaited = time.time(), len(hosts)
            got: list[CommandAck] = await super().collect(ident, hosts, timeout)
            seen.ended, seen.got = time.time(), len(got)
            return got

    return Timed


BOXES: dict[str, type[Any]] = {"old": LegacyAckBox, "new": AckBox}


def legacy_nodes(store: Store) -> Callable[[str], Awaitable[list[NodeRecord]]]:
    """:meth:`Store.nodes` as the view read them before, the baseline: a ``GET`` a host."""
    async def nodes(job: str) -> list[NodeRecord]:
        found = []
        async for key in store.redis.scan_iter(match=store.keys.node(job, "*")):
            raw = await store.redis.get(key)
            if raw:
                found.append(decode_node_record(raw))
        return found

    return nodes


async def box_cost(box: type[Any], n: int) -> float:
    """Milliseconds ``box`` takes to collect ``n`` acks that come one per turn of the loop
    (as acks from separate reads of the socket do): the bookkeeping alone."""
    hosts = [f"host-{h}" for h in range(n)]
    acks = [CommandAck(command_id="c", job="j", responder=f"host-{h}", outcome="done")
            for h in hosts]
    inbox = box()
    t = time.perf_counter()
    waiting = asyncio.create_task(inbox.collect("c", hosts, 60.0))
    await asyncio.sleep(0)
    for ack in acks:
        inbox.add(ack)
        await asyncio.sleep(0)
    await waiting
    return round((time.perf_counter() - t) * 1000, 1)


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
    """The simulated ranks and agents of ``shape``."""

    def __init__(self, bus: Bus, job: str, shape: Shape,
                 gone: frozenset[str] | None = None) -> None:
        self.bus, self.s, self.job, self.shape = bus, bus.subjects, job, shape
        self.gone = shape.lost if gone is None else gone
        """The hosts whose agents never answer (the lost switch's)."""
        self.silent: frozenset[str] = frozenset()
        """Hosts whose ranks and agent have fallen silent."""
        self.silent_ranks: set[int] = set()
        """Ranks that have fallen silent (their process is gone)."""
        self.stalled_at: float | None = None
        """When the job stopped stepping (its ranks wait in a collective), if it has."""
        self.holders: frozenset[int] = frozenset()
        """Ranks that stay in ``compute`` while the stalled job waits for them (a hang)."""
        self.seq = 0
        self.step = 0
        self.started = time.time()
        self.commands: dict[str, tuple[float, Command]] = {}
        """Commands the agents heard: id -> (arrival, command)."""

    async def hello(self, ranks: bool = True) -> None:
        """Every agent's and rank's (``ranks``) hello, many in flight at once."""
        shape, hosts = self.shape, self.shape.hosts
        node = [(self.s.reg_node(self.job, f"host-{h}"), NodeHello(
            job=self.job, host=f"host-{h}", local_ranks=list(range(shape.per_host)),
            nnodes_min=hosts // 2, nnodes_max=hosts, hosts_store=h == 0, time=time.time()))
            for h in range(hosts)]
        rank = [(self.s.reg_rank(self.job, r), RankHello(
            job=self.job, rank=r, world_size=shape.ranks, local_rank=r % shape.per_host,
            host=shape.host(r), pid=100_000 + r, attempt=Attempt(pid=100_000 + r),
            time=time.time())) for r in range(shape.ranks if ranks else 0)]
        hellos: list[tuple[str, Any]] = [*node, *rank]
        for at in range(0, len(hellos), 256):
            await asyncio.gather(*(self.bus.publish_durable(subject, msg, retry_for=60.0)
                                   for subject, msg in hellos[at:at + 256]))  # loaded hosts

    async def acks(self, nc: Any) -> None:
        """The survivors' agents acknowledge every command sent to them, each on its own
        (one task an agent, all at once: agents are independent)."""
        alive = sorted({f"host-{h}" for h in range(self.shape.hosts)} - self.gone)

        async def answer(cmd: Command, host: str) -> None:
            await self.bus.publish_durable(self.s.ack(self.job, cmd.issuer), CommandAck(
                command_id=cmd.id, job=self.job, responder=f"host-{host}",
                outcome="done", kind=cmd.kind))

        async def cb(msg: Any) -> None:
            cmd = decode_durable(msg.data, Command)
            self.commands.setdefault(cmd.id, (time.time(), cmd))
            target = cmd.target.removeprefix("host.")
            hosts = alive if cmd.target == "all" else [h for h in alive if h == target]
            await asyncio.gather(*(answer(cmd, host) for host in hosts))

        await nc.subscribe(self.s.pattern("cmd", job=self.job, tail=">"), cb=cb)

    def lose(self) -> None:
        """The lost hosts (:attr:`gone`) fall silent, and the others stop stepping."""
        self.silent = self.gone
        self.stall()

    def stall(self, holders: Collection[int] = ()) -> None:
        """The job stops stepping: every rank waits in a collective but ``holders``."""
        self.stalled_at = time.time()
        self.holders = frozenset(holders)

    async def run(self, stop: asyncio.Event) -> None:
        """Beat and step until ``stop`` (:func:`drive`, this fleet alone)."""
        await drive([self], stop, self.shape.beat_every)

    async def ranks(self, slot: int, now: float) -> None:
        """The ranks of ``slot``: a heartbeat each, and a step report while the job steps."""
        shape = self.shape
        stalled = self.stalled_at
        if slot == 0 and stalled is None:
            self.step += 1
        for r in range(slot, shape.ranks, SLOTS):
            host = shape.host(r)
            if host in self.silent or r in self.silent_ranks:
                continue
            self.seq += 1
            if stalled is None:
                await self.bus.publish_telemetry(self.s.step(self.job, r), StepReport(
                    job=self.job, time=now, seq=self.seq, rank=r, step=self.step,
                    duration=shape.beat_every,
                    phases={"data": 0.01, "compute": 0.8, "comm": 0.19},
                    loss=2.0, grad_norm=1.0))
            await self.bus.publish_telemetry(self.s.hb(self.job, r), Heartbeat(
                job=self.job, time=now, seq=self.seq, rank=r, host=host,
                pid=100_000 + r, step=self.step,
                phase="compute" if stalled is None or r in self.holders else "comm",
                phase_elapsed=0.1 if stalled is None else max(0.1, now - stalled)))

    async def agents(self, slot: int, now: float) -> None:
        shape = self.shape
        for h in range(slot, shape.hosts, SLOTS):
            host = f"host-{h}"
            if host in self.silent:
                continue
            self.seq += 1
            local = range(h * shape.per_host, (h + 1) * shape.per_host)
            await self.bus.publish_telemetry(self.s.node(self.job, host), NodeHeartbeat(
                job=self.job, time=now, seq=self.seq, host=host,
                ranks=dict.fromkeys(local, "S"), pids={r: 100_000 + r for r in local}))


async def drive(fleets: list[Fleet], stop: asyncio.Event, beat_every: float,
                lag: list[float] | None = None) -> None:
    """Beat and step ``fleets`` until ``stop``: each rank once a beat period in its slot,
    each agent once a second in its slot of the second. ``lag`` gets, for every slot, how
    late its beats went out (seconds after the slot's time: the generator falling behind)."""
    slot = 0
    period = beat_every / SLOTS
    t0 = start = time.monotonic()
    beats = 0  # agents' slots beaten so far (SLOTS a second)
    while not stop.is_set():
        if lag is not None:
            lag.append(time.monotonic() - t0)
        now = time.time()
        for fleet in fleets:
            await fleet.ranks(slot, now)
        while beats <= (time.monotonic() - start) * SLOTS:
            for fleet in fleets:
                await fleet.agents(beats % SLOTS, now)
            beats += 1
        slot = (slot + 1) % SLOTS
        t0 += period
        await asyncio.sleep(max(0.0, t0 - time.monotonic()))


async def watch(nc: Any, prefix: str, job: str, seen: Seen) -> None:
    """Record the anomalies, diagnoses and incidents of ``job`` (``*``: every job)."""
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

    await nc.subscribe(s.pattern("event", job=job, tail="anomaly"), cb=on_anomaly)
    await nc.subscribe(s.pattern("event", job=job, tail="diagnosis"), cb=on_diagnosis)
    await nc.subscribe(s.pattern("event", job=job, tail="incident"), cb=on_incident)
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


async def connect(plane: EmbeddedControlPlane, prefix: str) -> tuple[Any, Bus]:
    """The simulator's NATS connection (one for every rank and agent), the deployment's
    streams provisioned, and a bus on it."""
    nc = await nats.connect(plane.nats.url, pending_size=256 * 1024 * 1024)
    await provision(nc.jetstream(), streams(prefix))
    return nc, Bus(nc, Subjects(prefix), source="bench")


@dataclass(frozen=True)
class Run:
    """One run's settings."""

    shape: Shape
    window: float
    acks: str
    """Which ack box the remediator uses (:data:`BOXES`)."""
    observe: float
    warmup: float


async def one_run(plane: EmbeddedControlPlane, tmp: Path, run: Run,
                  n: int = 0) -> dict[str, Any]:
    shape = run.shape
    prefix, job = f"fleet{int(run.window * 10)}{run.acks}{n}", f"llm-{shape.ranks // 1024}k"
    base = {"nats_url": plane.nats.url, "redis_url": plane.redis.url, "prefix": prefix}
    (tmp / "topology.toml").write_text(topology(shape))
    pages = Pages()
    nc, bus = await connect(plane, prefix)
    fleet = Fleet(bus, job, shape)
    seen = Seen()
    await watch(nc, prefix, job, seen)
    await fleet.acks(nc)

    def settings(cls: type[Settings], **kw: Any) -> Any:
        return load_settings(cls, env={}, overrides={**base, **kw})

    remediator = RemediatorService(settings(RemediatorSettings))
    box = timed(BOXES[run.acks])()
    remediator._acks = box  # the same box, timed; "old": the baseline's
    services: list[Service[Any]] = [
        DetectorService(settings(DetectorSettings)),
        DiagnoserService(settings(DiagnoserSettings, domain_window=run.window,
                                  topology=str(tmp / "topology.toml"))),
        remediator,
        BridgeService(settings(BridgeSettings, webhook_url=f"{pages.url}/ce")),
    ]
    stop = asyncio.Event()
    views: dict[str, float] = {}
    try:
        async with serving(services):
            if run.acks == "old":  # the remediator as it was: its view's reads too
                remediator.store.nodes = legacy_nodes(remediator.store)  # type: ignore[method-assign]
            detector = services[0]
            assert isinstance(detector, DetectorService)
            await fleet.hello()
            sim = asyncio.create_task(fleet.run(stop))
            await asyncio.sleep(run.warmup)  # the detector takes the job, learns its steps
            for _ in range(120):  # a large job's hellos may take longer
                if job in detector.owned:
                    break
                await asyncio.sleep(0.5)
            else:
                raise RuntimeError(f"the detector did not take {job} within the warm-up")
            onset = time.time()  # the switch dies: no beat of its ranks from now on
            fleet.lose()
            await asyncio.sleep(run.observe)
            stop.set()
            await sim
            views = await view_reads(remediator.store, job)
    finally:
        pages.server.shutdown()
        await nc.close()
    result = summarize(seen, pages, onset, run)
    return {**result, "acks": run.acks, **fanout(fleet, box.seen, seen, onset), **views,
            "box_cost_ms": await box_cost(BOXES[run.acks], shape.hosts)}


async def decision_run(plane: EmbeddedControlPlane, run: Run, n: int) -> dict[str, Any]:
    """One decision that reaches every agent, the remediator alone: a ``network``
    diagnosis (the policy's plan: restart the group, to ``cmd.all``) published as the
    diagnoser would, for a job whose every agent said hello and answers."""
    shape = run.shape
    prefix, job = f"decide{run.acks}{n}", f"llm-{shape.ranks // 1024}k"
    base = {"nats_url": plane.nats.url, "redis_url": plane.redis.url, "prefix": prefix}
    nc, bus = await connect(plane, prefix)
    fleet = Fleet(bus, job, shape, gone=frozenset())
    seen = Seen()
    await watch(nc, prefix, job, seen)
    await fleet.acks(nc)
    remediator = RemediatorService(load_settings(RemediatorSettings, env={}, overrides=base))
    box = timed(BOXES[run.acks])()
    remediator._acks = box
    views: dict[str, float] = {}
    try:
        async with serving([remediator]):
            if run.acks == "old":  # the remediator as it was: its view's reads too
                remediator.store.nodes = legacy_nodes(remediator.store)  # type: ignore[method-assign]
            await fleet.hello(ranks=False)
            for _ in range(600):  # every agent's node record is in (the view's hosts)
                if len(await remediator.store.nodes(job)) >= shape.hosts:
                    break
                await asyncio.sleep(0.1)
            culprit = shape.hosts // 2
            d = Diagnosis(id=uuid7(), job=job, anomaly_ids=[uuid7()], cause="network",
                          confidence=0.9, hosts=[f"host-{culprit}"],
                          ranks=list(range(culprit * shape.per_host,
                                           (culprit + 1) * shape.per_host)),
                          summary="collective timed out on host's NIC", time=time.time())
            onset = time.time()
            await bus.publish_durable(bus.subjects.event(job, "diagnosis"), d)
            for _ in range(int(run.observe * 10)):
                if any(c.ended for c in box.seen.values()):
                    break
                await asyncio.sleep(0.1)
            views = await view_reads(remediator.store, job)
    finally:
        await nc.close()
    return {"acks": run.acks, "hosts": shape.hosts, "ranks": shape.ranks,
            **fanout(fleet, box.seen, seen, onset), **views,
            "box_cost_ms": await box_cost(BOXES[run.acks], shape.hosts)}


async def view_reads(store: Store, job: str, times: int = 5) -> dict[str, float]:
    """The node records of the job read as the remediator's view did (a ``GET`` a host
    after the scan) and as it does (:meth:`Store.nodes`), side by side, median ms."""
    async def one_by_one() -> int:
        found = 0
        async for key in store.redis.scan_iter(match=store.keys.node(job, "*")):
            found += await store.redis.get(key) is not None
        return found

    async def batched() -> int:
        return len(await Store.nodes(store, job))  # the class's, whichever the run uses

    out: dict[str, float] = {}
    for name, read in (("view_nodes_get_each_ms", one_by_one),
                       ("view_nodes_mget_ms", batched)):
        took = []
        for _ in range(times):
            t = time.perf_counter()
            await read()
            took.append((time.perf_counter() - t) * 1000)
        out[name] = round(statistics.median(took), 1)
    return out


def fanout(fleet: Fleet, boxes: dict[str, Collected], seen: Seen,
           onset: float) -> dict[str, Any]:
    """The group's restart (to ``cmd.all``) after the loss: issued, heard by the agents,
    each ack at the remediator, all collected; seconds from the command's issue."""
    restarts = sorted(((at, cmd) for at, cmd in fleet.commands.values()
                       if cmd.kind == "restart" and cmd.target == "all"),
                      key=lambda x: x[1].issued_at or 0.0)
    if not restarts:
        return {"fanout": None}
    heard, cmd = restarts[0]
    issued = cmd.issued_at or heard
    got = boxes.get(cmd.id, Collected())
    arrivals = sorted(t - issued for t in got.arrived)
    step_done = [t for revs in seen.incidents.values() for t, inc in revs
                 if any(cmd.id in s.command_ids and s.status == "done" for s in inc.actions)]
    detail = next((s.detail for revs in seen.incidents.values() for _, inc in revs
                   for s in inc.actions if cmd.id in s.command_ids and s.status == "done"), "")

    def ms(x: float | None) -> float | None:
        return round(x * 1000, 1) if x is not None else None

    def pct(q: float) -> float | None:
        return ms(arrivals[min(len(arrivals) - 1, int(q * len(arrivals)))]) \
            if arrivals else None

    return {"fanout": {
        "onset_to_issued_s": round(issued - onset, 2),
        "agents_awaited": got.awaited, "acks": len(got.arrived), "acks_collected": got.got,
        "sends": len(restarts),
        "issued_to_agents_ms": ms(heard - issued),
        "first_ack_ms": ms(arrivals[0]) if arrivals else None,
        "p50_ack_ms": pct(0.50), "p99_ack_ms": pct(0.99),
        "last_ack_ms": ms(arrivals[-1]) if arrivals else None,
        "collected_ms": ms(got.ended - issued) if got.ended else None,
        "last_ack_to_collected_ms": ms(got.ended - issued - arrivals[-1])
        if got.ended and arrivals else None,
        "step_done_seen_ms": ms(min(step_done) - issued) if step_done else None,
        "detail_chars": len(detail),
        "detail_chars_one_line_an_ack": len("; ".join(
            f"host-host-{h}: done" for h in range(got.got))),
    }}


def summarize(seen: Seen, pages: Pages, onset: float, run: Run) -> dict[str, Any]:
    shape, window = run.shape, run.window
    lost_ranks = {r for r in range(shape.ranks) if shape.host(r) in shape.lost}
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
        "ranks": shape.ranks, "hosts": shape.hosts, "lost_hosts": len(shape.lost),
        "beat_every_s": shape.beat_every,
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


FAN_ROWS = [("onset -> restart issued (s)", "onset_to_issued_s"),
            ("agents awaited", "agents_awaited"), ("acks at the remediator", "acks"),
            ("acks collected", "acks_collected"), ("sends", "sends"),
            ("issued -> heard by the agents (ms)", "issued_to_agents_ms"),
            ("issued -> first ack (ms)", "first_ack_ms"),
            ("issued -> p50 ack (ms)", "p50_ack_ms"),
            ("issued -> p99 ack (ms)", "p99_ack_ms"),
            ("issued -> last ack (ms)", "last_ack_ms"),
            ("issued -> all collected (ms)", "collected_ms"),
            ("last ack -> collected (ms)", "last_ack_to_collected_ms"),
            ("issued -> step done seen (ms)", "step_done_seen_ms"),
            ("step detail (chars)", "detail_chars"),
            ("one line an ack would be (chars)", "detail_chars_one_line_an_ack")]
SWITCH_ROWS = [("anomalies", "anomalies"), ("diagnoses", "diagnoses"),
               ("incidents", "incidents"), ("pages (webhook, firing)", "pages"),
               ("onset -> first anomaly (s)", "detection_s"),
               ("onset -> all lost ranks named (s)", "all_lost_ranks_named_s"),
               ("onset -> first decision (s)", "first_decision_s"),
               ("onset -> last incident decided (s)", "last_incident_decided_s"),
               ("hosts isolated in one step", "isolated_in_one_step"),
               ("onset -> isolation done (s)", "isolated_s"),
               ("onset -> restart acknowledged (s)", "restarted_s")]


def table(title: str, heads: list[str], rows: list[tuple[str, Any]]) -> None:
    print(f"\n| {title} | " + " | ".join(heads) + " |\n| --- |" + " --- |" * len(heads))
    for label, cells in rows:
        print(f"| {label} | " + " | ".join(str(c) for c in cells) + " |")


def report(shape: Shape, scenario: str, results: list[dict[str, Any]]) -> None:
    load = os.getloadavg()
    print(f"load: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (1/5/15 min) on "
          f"{os.cpu_count()} cores")
    if scenario == "switch":
        heads = [f"window {r['domain_window_s']:g} s, acks {r['acks']}" for r in results]
        table(f"switch lost, {shape.ranks:,} ranks ({len(shape.lost)} of {shape.hosts} "
              "hosts)", heads, [(label, [r[key] for r in results])
                                for label, key in SWITCH_ROWS])
    else:
        heads = [f"acks {r['acks']}" for r in results]
    fan = [(label, [(r["fanout"] or {}).get(key) for r in results])
           for label, key in FAN_ROWS]
    fan += [(label, [r.get(key) for r in results]) for label, key in (
        ("view: node records, a GET each (ms, median of 5)", "view_nodes_get_each_ms"),
        ("view: node records, MGET (ms, median of 5)", "view_nodes_mget_ms"),
        (f"this run's ack box: {shape.hosts:,} acks one per loop turn (ms)",
         "box_cost_ms"))]
    table(f"the group's restart to cmd.all, {shape.hosts:,} agents ({scenario})", heads, fan)
    for r in results:
        if scenario == "switch":
            print(f"window {r['domain_window_s']:g}, acks {r['acks']}: causes "
                  f"{r['incident_causes']}, domains {r['domains']}, plans {r['plans']}, "
                  f"anomaly kinds {r['anomaly_kinds']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--scenario", choices=("switch", "decision"), default="switch",
                    help="switch: the whole control plane and the ranks' telemetry; "
                         "decision: the remediator alone, one diagnosis injected")
    ap.add_argument("--observe", type=float, default=25.0,
                    help="seconds each run goes on after the loss (the diagnosis)")
    ap.add_argument("--warmup", type=float, default=8.0)
    ap.add_argument("--hosts", type=int, default=Shape.hosts)
    ap.add_argument("--per-host", type=int, default=Shape.per_host)
    ap.add_argument("--beat-every", type=float, default=Shape.beat_every,
                    help="seconds between a rank's heartbeats and step reports")
    ap.add_argument("--windows", default=f"0,{DiagnoserSettings.domain_window:g}",
                    help="the diagnoser's domain_window of each run, in order (switch)")
    ap.add_argument("--acks", default="new",
                    help="ack boxes to run, in order: old (the baseline), new")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each, interleaved")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    shape = Shape(hosts=args.hosts, per_host=args.per_host, beat_every=args.beat_every)
    windows = args.windows.split(",") if args.scenario == "switch" else ["0"]
    runs = [Run(shape, float(w), a, args.observe, args.warmup)
            for _ in range(args.repeat) for a in args.acks.split(",") for w in windows]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        plane = EmbeddedControlPlane(Path(tmp) / "plane").start()
        try:
            for n, run in enumerate(runs):
                results.append(asyncio.run(
                    one_run(plane, Path(tmp), run, n) if args.scenario == "switch"
                    else decision_run(plane, run, n)))
        finally:
            plane.stop()
    report(shape, args.scenario, results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
