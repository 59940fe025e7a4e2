"""A switch lost, on real NATS and Redis with the real detector, diagnoser, remediator and
bridge: 16 hosts x 4 ranks, the 8 hosts of switch sw-1 go silent at once (their agents
too). One incident names the switch, pages once, isolates the 8 hosts in one step and
restarts the job once; it resolves when the survivors train on in the next attempt. The
same 8 hosts' ranks all crashing at once (a storm) are one incident, one page, one restart."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from tests.alerting import Receiver
from tests.conftest import wait_until
from tests.integration.recorder import running
from tests.integration.test_bridge import bridging
from trainguard.contract.codec import decode_durable
from trainguard.contract.schemas import (
    Attempt,
    Command,
    CommandAck,
    Diagnosis,
    Heartbeat,
    Incident,
    NodeHello,
    RankHello,
    StepReport,
    WorkerExit,
)
from trainguard.contract.subjects import Subjects
from trainguard.core.connection import flush
from trainguard.runtime.bus import Bus
from trainguard.runtime.config import load_settings
from trainguard.runtime.state import Keys
from trainguard.runtime.topology import provision, streams
from trainguard.services.bridge.settings import BridgeSettings
from trainguard.services.detector.service import DetectorService
from trainguard.services.detector.settings import DetectorSettings
from trainguard.services.diagnoser.service import DiagnoserService
from trainguard.services.diagnoser.settings import DiagnoserSettings
from trainguard.services.remediator.service import RemediatorService
from trainguard.services.remediator.settings import RemediatorSettings

WAIT = 60.0
"""Generous: four services and the servers share two busy cores."""
HOSTS, PER_HOST = 16, 4
LOST = [f"host-{i}" for i in range(8)]
TOPOLOGY = """\
[[domains]]
level = "switch"
name = "sw-1"
hosts = ["host-[0-7]"]

[[domains]]
level = "switch"
name = "sw-2"
hosts = ["host-[8-15]"]
"""


class Job:
    """64 ranks publishing as the client does; the lost hosts' ranks fall silent. A restart
    renumbers the survivors from 0, as torchrun does."""

    def __init__(self, bus: Bus, job: str) -> None:
        self.bus, self.s, self.job = bus, bus.subjects, job
        self.alive = {f"host-{h}" for h in range(HOSTS)}
        self.layout = {r: f"host-{r // PER_HOST}" for r in range(HOSTS * PER_HOST)}
        self.step, self.seq, self.restarts, self.stepping = 0, 0, 0, True

    def ranks(self) -> list[int]:
        return [r for r, h in self.layout.items() if h in self.alive]

    def restart(self) -> None:
        hosts = sorted(self.alive, key=lambda h: int(h.split("-")[1]))
        self.layout = {i: h for i, (h, _) in enumerate(
            (h, k) for h in hosts for k in range(PER_HOST))}
        self.restarts += 1

    def pid(self, rank: int) -> int:
        return 10_000 * (self.restarts + 1) + rank

    async def hello(self) -> None:
        for r in self.ranks():
            await self.bus.publish_durable(self.s.reg_rank(self.job, r), RankHello(
                job=self.job, rank=r, world_size=len(self.layout), local_rank=r % PER_HOST,
                host=self.layout[r], pid=self.pid(r),
                attempt=Attempt(restart_count=self.restarts, pid=self.pid(r)),
                time=time.time()))

    async def tick(self) -> None:
        now = time.time()
        for r in self.ranks():
            self.seq += 1
            if self.stepping:
                await self.bus.publish_telemetry(self.s.step(self.job, r), StepReport(
                    job=self.job, time=now, seq=self.seq, rank=r, step=self.step,
                    attempt=self.restarts, duration=0.1,
                    phases={"compute": 0.08, "comm": 0.02}, loss=2.0, grad_norm=1.0))
            await self.bus.publish_telemetry(self.s.hb(self.job, r), Heartbeat(
                job=self.job, time=now, seq=self.seq, rank=r, host=self.layout[r],
                pid=self.pid(r), attempt=self.restarts, step=self.step,
                phase="compute" if self.stepping else "comm", phase_elapsed=0.05))
        if self.stepping:
            self.step += 1

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        async def loop() -> None:
            while True:
                await self.tick()
                await asyncio.sleep(0.1)

        task = asyncio.create_task(loop())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


class Agents:
    """The survivors' agents: acknowledge every command sent to them (the lost hosts'
    agents are gone with their switch: nobody answers for them)."""

    def __init__(self, nc: Any, bus: Bus, job: str, alive: set[str]) -> None:
        self.nc, self.bus, self.s, self.job, self.alive = nc, bus, bus.subjects, job, alive
        self.commands: list[Command] = []

    async def start(self) -> None:
        async def cb(msg: Any) -> None:
            cmd = decode_durable(msg.data, Command)
            self.commands.append(cmd)
            target = cmd.target.removeprefix("host.")
            for host in sorted(self.alive if cmd.target == "all" else {target} & self.alive):
                await self.bus.publish_durable(self.s.ack(self.job, cmd.issuer), CommandAck(
                    command_id=cmd.id, job=self.job, responder=f"host-{host}",
                    outcome="done", kind=cmd.kind))

        await self.nc.subscribe(self.s.pattern("cmd", job=self.job, tail=">"), cb=cb)
        for h in range(HOSTS):
            await self.bus.publish_durable(self.s.reg_node(self.job, f"host-{h}"), NodeHello(
                job=self.job, host=f"host-{h}", local_ranks=list(range(PER_HOST)),
                nnodes_min=4, nnodes_max=HOSTS, hosts_store=h == HOSTS - 1,
                time=time.time()))


async def events(nc: Any, prefix: str, job: str, kind: str, cls: Any) -> list[Any]:
    got: list[Any] = []

    async def cb(msg: Any) -> None:
        got.append(decode_durable(msg.data, cls))

    await nc.subscribe(Subjects(prefix).event(job, kind), cb=cb)
    await flush(nc)
    return got


def latest(incidents: list[Incident]) -> dict[str, Incident]:
    out: dict[str, Incident] = {}
    for inc in incidents:
        if inc.id not in out or inc.rev >= out[inc.id].rev:
            out[inc.id] = inc
    return out


@dataclass
class Plane:
    """The control plane around one simulated job, what it published and who paged."""

    ranks: Job
    agents: Agents
    receiver: Receiver
    incidents: list[Incident]
    diagnoses: list[Diagnosis]
    bus: Bus

    def latest(self) -> dict[str, Incident]:
        return latest(self.incidents)

    async def until_restarted(self, back: frozenset[str] = frozenset()) -> None:
        """The incident's restart done; then the survivors (and the hosts ``back``) come
        back in the next attempt and train on, until the incident resolves."""
        await wait_until(lambda: any(s.action == "restart" and s.status == "done"
                                     for i in self.latest().values() for s in i.actions),
                         timeout=WAIT, what="the incident's restart done")
        self.ranks.alive |= back
        self.ranks.restart()
        await self.ranks.hello()
        self.ranks.stepping = True
        await wait_until(lambda: any(i.status == "resolved" for i in self.latest().values()),
                         timeout=WAIT, what="the incident resolved")


@contextlib.asynccontextmanager
async def plane(nats_url: str, redis_url: str, prefix: str, job: str, nc: Any,
                diagnoser: dict[str, Any]) -> AsyncIterator[Plane]:
    """The real detector, diagnoser (``diagnoser``: its settings), remediator and bridge
    on the servers, the agents answering, the job's 64 ranks stepping 20 steps in."""
    base = {"nats_url": nats_url, "redis_url": redis_url, "prefix": prefix}
    await provision(nc.jetstream(), streams(prefix))
    receiver = Receiver().start()
    bus = Bus(nc, Subjects(prefix), source="test")
    ranks = Job(bus, job)
    agents = Agents(nc, bus, job, ranks.alive)
    p = Plane(ranks, agents, receiver, await events(nc, prefix, job, "incident", Incident),
              await events(nc, prefix, job, "diagnosis", Diagnosis), bus)
    detector = DetectorService(load_settings(DetectorSettings, env={}, overrides={
        **base, "tick_interval": 0.1, "progress_interval": 0.2, "lease_interval": 0.2,
        "lease_ttl": 1.5, "hb_timeout": 2.0}))
    services = [detector,
                DiagnoserService(load_settings(DiagnoserSettings, env={},
                                               overrides={**base, **diagnoser})),
                RemediatorService(load_settings(RemediatorSettings, env={},
                                                overrides={**base, "lease_ttl": 1.0}))]
    bridge = load_settings(BridgeSettings, env={}, overrides={
        **base, "webhook_url": f"{receiver.url}/ce"})
    try:
        async with contextlib.AsyncExitStack() as stack:
            for svc in services:
                await stack.enter_async_context(running(svc))
            await stack.enter_async_context(bridging(bridge))
            await agents.start()
            await ranks.hello()
            await wait_until(lambda: job in detector.owned, timeout=WAIT, what="job owned")
            async with ranks.running():
                await wait_until(lambda: ranks.step >= 20, timeout=WAIT, what="20 steps")
                yield p
    finally:
        receiver.stop()


@pytest.mark.parametrize("domain", ["switch sw-1", ""], ids=["topology", "no-topology"])
async def test_a_lost_switch_is_one_incident_one_page_one_isolation(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any,
        tmp_path: Path, domain: str) -> None:
    """Without a topology the same hosts are one loss too, "hosts lost together"."""
    (tmp_path / "topology.toml").write_text(TOPOLOGY)
    topology = str(tmp_path / "topology.toml") if domain else ""
    async with plane(nats_url, redis_url, prefix, job, nc,
                     {"domain_window": 1.5, "topology": topology}) as p:
        ranks, agents, receiver, diagnoses = p.ranks, p.agents, p.receiver, p.diagnoses
        # Switch sw-1 goes: its hosts' ranks fall silent, the rest wait for them.
        ranks.alive -= set(LOST)
        ranks.stepping = False
        failed_at = ranks.step
        await p.until_restarted()
        assert ranks.step > failed_at
        await wait_until(lambda: len(receiver.at("/ce")) >= 2, timeout=WAIT,
                         what="the page and its all-clear")
        (inc,) = p.latest().values()
        assert inc.cause == "hosts_lost" and inc.domain == domain
        assert inc.hosts == LOST and inc.ranks == list(range(8 * PER_HOST))
        isolate = [s for s in inc.actions if s.action == "isolate"]
        assert len(isolate) == 1 and isolate[0].params["hosts"] == LOST
        assert isolate[0].status == "done" and domain in isolate[0].detail
        assert [s.action for s in inc.actions] == ["isolate", "restart"]
        assert inc.summary.startswith(f"{domain or 'hosts lost together'}: 8 hosts, "
                                      "32 ranks lost within")
        # One diagnosis for the eight silences (a hang joins it, if one was raised).
        opened = {d.id for d in diagnoses if d.status == "open"}
        assert len(opened) == 1, [(d.cause, d.hosts) for d in diagnoses]
        sent = [c for c in agents.commands if c.kind == "isolate"]
        assert sorted(c.target for c in sent) == sorted(f"host.{h}" for h in LOST)
        assert [c.target for c in agents.commands if c.kind == "restart"] == ["all"]
        r = aioredis.Redis.from_url(redis_url, decode_responses=True)
        try:
            blocked = set(await r.hkeys(Keys(prefix).blocklist()))
        finally:
            await r.aclose()
        assert set(LOST) <= blocked and not blocked - set(LOST)
        # One page: firing, then resolved; nothing per host.
        pages = receiver.at("/ce")
        assert [p.headers["ce-tgstate"] for p in pages] == ["firing", "resolved"]
        first = pages[0].json()
        assert (first["cause"], first["domain"], first["id"]) == ("hosts_lost",
                                                                 domain, inc.id)


TRACE = 'Traceback (most recent call last):\n  File "train.py", line 3\nKeyError: 17'


async def test_ranks_that_crash_together_on_many_hosts_are_one_incident_one_page_one_restart(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any) -> None:
    """A storm: every rank of 8 hosts exits with the same error within half a second (their
    agents report each exit). One incident names them all, pages once and restarts the
    job once."""
    async with plane(nats_url, redis_url, prefix, job, nc, {}) as p:
        ranks = p.ranks
        crashed = [r for r, h in ranks.layout.items() if h in LOST]
        ranks.alive -= set(LOST)
        ranks.stepping = False
        t0 = time.time()
        for i, r in enumerate(crashed):
            host = ranks.layout[r]
            await p.bus.publish_durable(p.bus.subjects.exit(job, host), WorkerExit(
                id=f"x{r}", job=job, host=host, rank=r, local_rank=r % PER_HOST,
                pid=ranks.pid(r), exit_code=1, stderr_tail=TRACE, generation=1,
                time=t0 + 0.015 * i))
        await p.until_restarted(back=frozenset(LOST))
        await wait_until(lambda: len(p.receiver.at("/ce")) >= 2, timeout=WAIT,
                         what="the page and its all-clear")
        (inc,) = p.latest().values()
        assert inc.cause == "process_crash" and inc.hosts == LOST
        assert set(crashed) <= set(inc.ranks)
        opened = {d.id for d in p.diagnoses if d.status == "open"}
        assert len(opened) == 1, [(d.cause, d.hosts) for d in p.diagnoses]
        assert [c.target for c in p.agents.commands if c.kind == "restart"] == ["all"]
        assert [x.headers["ce-tgstate"] for x in p.receiver.at("/ce")] == ["firing",
                                                                          "resolved"]
