"""The live dashboard in a real headless Chromium.

A 4-rank job of real Guards (one thread each, in this process) publishes on the real NATS
server; their "collective" is a barrier, so a rank stuck in ``data`` holds the others in
``comm`` as a real all-reduce would. The real detector, diagnoser and remediator run
against it. The page must render the four ranks, show the rank whose compute is slow as the
slow row, and show the hang's incident in the timeline with the stuck rank marked; the
test saves the screenshot the README shows (docs/img/dashboard.png).

At scale, 4,096 simulated ranks (the detector's synthetic job, published on the real NATS
server as the client publishes) with one hung rank, one straggler and a switch's hosts
lost together: the page's outliers, group counts and on-demand heat map must be right
(``bench/bench_dashboard.py`` times 1k to 16k ranks).

No gloo here: what the dashboard reads is the ranks' telemetry and the services' events,
which the Guards and services produce exactly as under torchrun; the e2e tests of the
client and the chaos suite cover the gloo side.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_until
from tests.e2e.browser import Browser, ensure_chromium
from tests.integration.recorder import running
from trainguard import Guard
from trainguard.contract.codec import encode_telemetry
from trainguard.contract.schemas import CheckpointCommitted, Heartbeat, Incident, StepReport
from trainguard.contract.subjects import Subjects
from trainguard.core.connection import flush
from trainguard.dashboard import DashboardServer, run_dashboard
from trainguard.runtime.bus import Bus
from trainguard.runtime.config import Settings, load_settings
from trainguard.runtime.topology import provision, streams
from trainguard.services.detector.service import DetectorService
from trainguard.services.detector.settings import DetectorSettings
from trainguard.services.detector.synthetic import SimConfig, SimJob
from trainguard.services.diagnoser.service import DiagnoserService
from trainguard.services.diagnoser.settings import DiagnoserSettings
from trainguard.services.remediator.service import RemediatorService
from trainguard.services.remediator.settings import RemediatorSettings

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "docs" / "img" / "dashboard.png"
WORLD = 4
SLOW_RANK, HUNG_RANK = 1, 2
WAIT = 90.0


@pytest.fixture(scope="module")
def chromium() -> None:
    why = ensure_chromium()
    if why:
        pytest.skip(why)


@pytest.fixture
def browser(chromium: None) -> Iterator[Browser]:
    b = Browser(width=1400, height=740)  # the page fits; the README shows it
    try:
        yield b
    finally:
        b.close()


class Job:
    """Four Guards stepping together: data, compute (rank 1 slower), comm (the barrier)."""

    def __init__(self, job: str, nats_url: str, prefix: str) -> None:
        self.job, self.nats_url, self.prefix = job, nats_url, prefix
        self.barrier = threading.Barrier(WORLD)
        self.hang = threading.Event()
        self.done = threading.Event()
        self.steps = [0] * WORLD
        self.threads = [threading.Thread(target=self._rank, args=(r,), daemon=True)
                        for r in range(WORLD)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        self.done.set()
        self.barrier.abort()  # releases the ranks waiting in "comm"
        for t in self.threads:
            t.join(30)

    def _rank(self, rank: int) -> None:
        guard = Guard(job=self.job, rank=rank, world_size=WORLD,
                      host=f"node-{'ab'[rank * 2 // WORLD]}", nats_url=self.nats_url,
                      prefix=self.prefix, heartbeat_interval=0.25)
        step = 0
        try:
            while not self.done.is_set():
                with guard.step(step) as s:
                    with s.phase("data"):
                        time.sleep(0.01)
                        while rank == HUNG_RANK and self.hang.is_set() and \
                                not self.done.is_set():
                            self.done.wait(0.1)  # stuck in the data loader
                    with s.phase("compute"):
                        time.sleep(0.25 if rank == SLOW_RANK else 0.1)
                    with s.phase("comm"):
                        self.barrier.wait()
                    s.report(loss=2.0 / (step + 1))
                self.steps[rank] = step
                step += 1
        except threading.BrokenBarrierError:
            pass
        finally:
            guard.close()


@contextlib.asynccontextmanager
async def dashboard(settings: Settings) -> AsyncIterator[DashboardServer]:
    stop = asyncio.Event()
    started: asyncio.Future[DashboardServer] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(run_dashboard(settings, port=0, stop=stop,
                                             started=started.set_result))
    done, _ = await asyncio.wait({task, started}, timeout=30,
                                 return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        task.result()
    try:
        yield started.result()
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


PAGE_STATE = """
const job = document.querySelector(`section[data-job="${arguments[0]}"]`);
if (!job) return null;
const rows = [...job.querySelectorAll("tr[data-rank]")];
return {
  ranks: rows.map(r => Number(r.dataset.rank)),
  cells: rows.map(r => r.querySelectorAll(".cell[data-step]").length),
  slow: rows.filter(r => r.dataset.slow === "true").map(r => Number(r.dataset.rank)),
  stuck: rows.filter(r => r.dataset.stuck === "true").map(r => Number(r.dataset.rank)),
  waiting: rows.filter(r => r.dataset.waiting === "true").map(r => Number(r.dataset.rank)),
  incidents: [...job.querySelectorAll("[data-incident-id]")].map(i => ({
    cause: i.dataset.cause, status: i.dataset.status, text: i.innerText})),
  checkpoint: job.querySelector('[data-stat="checkpoint"]').innerText,
  live: document.getElementById("conn").className,
};
"""


async def test_the_dashboard_shows_ranks_the_straggler_and_the_hang(
        browser: Browser, nats_url: str, redis_url: str, prefix: str, job: str,
        nc: Any) -> None:
    base = {"nats_url": nats_url, "redis_url": redis_url, "prefix": prefix}
    services = [
        DetectorService(load_settings(DetectorSettings, env={}, overrides={
            **base, "tick_interval": 0.2})),
        DiagnoserService(load_settings(DiagnoserSettings, env={}, overrides=base)),
        RemediatorService(load_settings(RemediatorSettings, env={}, overrides=base)),
    ]
    training = Job(job, nats_url, prefix)
    async with contextlib.AsyncExitStack() as stack:
        for svc in services:
            await stack.enter_async_context(running(svc))
        server = await stack.enter_async_context(
            dashboard(load_settings(Settings, env={}, overrides=base)))
        training.start()
        stack.callback(training.stop)
        await asyncio.to_thread(browser.get, f"http://127.0.0.1:{server.port}/")

        async def page(pred: Any, what: str) -> dict[str, Any]:
            async def check() -> Any:
                state = await asyncio.to_thread(browser.run, PAGE_STATE, job)
                return state if state and pred(state) else None
            result: dict[str, Any] = await wait_until(check, timeout=WAIT, interval=0.5,
                                                      what=what)
            return result

        state = await page(lambda s: sorted(s["ranks"]) == list(range(WORLD)) and
                           min(s["cells"]) >= 30 and s["slow"] == [SLOW_RANK],
                           "four ranks, rank 1 the slow row")
        assert state["live"] == "live" and state["stuck"] == []
        # The coordinator's commits, as it publishes them (its own tests cover how).
        bus, s = Bus(nc, Subjects(prefix), source="test"), Subjects(prefix)
        for step in (10, 20):
            await bus.publish_durable(s.event(job, "checkpoint"), CheckpointCommitted(
                id=f"c{step}", job=job, step=step, path=f"/ckpt/{job}/step-{step}",
                world_size=WORLD))
        await page(lambda s: "last checkpoint: step 20" in s["checkpoint"],
                   "the checkpoint line")

        training.hang.set()
        state = await page(lambda s: any(i["cause"] == "rank_hang" for i in s["incidents"])
                           and HUNG_RANK in s["stuck"], "the hang's incident, rank 2 stuck")
        hang = next(i for i in state["incidents"] if i["cause"] == "rank_hang")
        assert f"ranks {HUNG_RANK}" in hang["text"], hang
        assert "dump" in hang["text"]  # the first action of its plan
        assert state["slow"] == [SLOW_RANK]
        # The others wait in the collective for it: waiting, not stuck.
        state = await page(lambda s: sorted(s["waiting"]) == [0, 1, 3],
                           "the other ranks waiting in comm")
        assert state["stuck"] == [HUNG_RANK]
        await asyncio.to_thread(browser.screenshot, SCREENSHOT)
    assert SCREENSHOT.stat().st_size > 10_000


BIG_WORLD, PER_HOST = 4096, 8
BIG_HUNG, BIG_SLOW = 1234, 3001
LOST_HOSTS = [f"node-{h}" for h in range(100, 104)]  # one switch's hosts, lost together

BIG_STATE = """
const job = document.querySelector(`section[data-job="${arguments[0]}"]`);
if (!job) return null;
const top = [...job.querySelectorAll("tr[data-rank]")];
const groups = [...job.querySelectorAll("tr[data-group]")];
const rest = job.querySelector("tr[data-collapsed]");
const map = job.querySelector("canvas[data-heatmap]");
const num = (rows, k) => rows.reduce((a, r) => a + Number(r.dataset[k]), 0);
return {
  top: top.map(r => ({rank: Number(r.dataset.rank), stuck: r.dataset.stuck === "true",
                      slow: r.dataset.slow === "true"})),
  groups: Object.fromEntries(groups.map(g => [g.dataset.group, {kind: g.dataset.kind,
    ranks: Number(g.dataset.ranks), hung: Number(g.dataset.hung),
    lost: Number(g.dataset.lost)}])),
  ranks: num(groups, "ranks") + (rest ? Number(rest.dataset.ranks) : 0),
  hung: num(groups, "hung") + (rest ? Number(rest.dataset.hung) : 0),
  rows: job.querySelectorAll("tr").length,
  map: map ? {cells: Number(map.dataset.cells || 0), hung: Number(map.dataset.hung || 0)} : null,
};
"""


async def publish_sim(nc: Any, prefix: str, sim_messages: list[Any]) -> None:
    """The simulated ranks' telemetry on the real bus, as each rank's client sends it."""
    s = Subjects(prefix)
    for n, msg in enumerate(sim_messages):
        if isinstance(msg, Heartbeat):
            await nc.publish(s.hb(msg.job, msg.rank), encode_telemetry(msg))
        elif isinstance(msg, StepReport):
            await nc.publish(s.step(msg.job, msg.rank), encode_telemetry(msg))
        if n % 2000 == 0:
            await flush(nc)  # bounded pending bytes, as a real fleet's many connections
    await flush(nc)


async def test_thousands_of_ranks_grouped_with_the_outliers_first_and_a_heat_map_on_demand(
        browser: Browser, nats_url: str, redis_url: str, prefix: str, job: str,
        nc: Any) -> None:
    base = {"nats_url": nats_url, "redis_url": redis_url, "prefix": prefix}
    messages: list[Any] = []
    sim = SimJob(SimConfig(job=job, ranks=BIG_WORLD, ranks_per_host=PER_HOST,
                           slow_step_prob=0.0, start_time=time.time() - 60),
                 messages.append)
    sim.slow[BIG_SLOW] = 1.8
    sim.steps(12)
    lost = {r for r in range(BIG_WORLD) if sim.host(r) in LOST_HOSTS}
    sim.silent |= lost
    sim.stall(10.0, lambda r: "data" if r == BIG_HUNG else "comm")
    await provision(nc.jetstream(timeout=10.0), streams(prefix))  # the event stream
    async with dashboard(load_settings(Settings, env={}, overrides=base)) as server:
        await asyncio.to_thread(browser.get, f"http://127.0.0.1:{server.port}/")
        await publish_sim(nc, prefix, messages)
        bus, s = Bus(nc, Subjects(prefix), source="test"), Subjects(prefix)
        await bus.publish_durable(s.event(job, "incident"), Incident(
            id="i-sw", job=job, cause="hosts_lost", hosts=LOST_HOSTS, domain="switch sw-1",
            ranks=sorted(lost), detected_at=time.time()))

        async def page(pred: Any, what: str) -> dict[str, Any]:
            async def check() -> Any:
                state = await asyncio.to_thread(browser.run, BIG_STATE, job)
                return state if state and pred(state) else None
            result: dict[str, Any] = await wait_until(check, timeout=WAIT, interval=0.5,
                                                      what=what)
            return result

        state = await page(lambda s: s["ranks"] == BIG_WORLD and s["top"][0]["stuck"]
                           and "switch sw-1" in s["groups"], "all ranks grouped, the hang")
        assert [r["rank"] for r in state["top"][:2]] == [BIG_HUNG, BIG_SLOW], state["top"]
        assert state["top"][1]["slow"] and not state["top"][1]["stuck"]
        assert [r["rank"] for r in state["top"] if r["stuck"]] == [BIG_HUNG]
        assert state["groups"]["switch sw-1"] == {"kind": "domain", "ranks": len(lost),
                                                  "hung": 0, "lost": len(lost)}
        hung_host = state["groups"][sim.host(BIG_HUNG)]
        assert hung_host == {"kind": "host", "ranks": PER_HOST, "hung": 1, "lost": 0}
        assert state["hung"] == 1
        assert state["rows"] < 200  # bounded: not one row per rank
        assert state["map"] is None  # the heat map is drawn on demand only

        await asyncio.to_thread(browser.run, f"""document.querySelector(
            '[data-heatmap-toggle="{job}"]').click();""")
        state = await page(lambda s: s["map"] and s["map"]["cells"] == BIG_WORLD,
                           "the heat map, one cell per rank")
        assert state["map"]["hung"] == 1
