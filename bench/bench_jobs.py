"""Many jobs on one control plane: one job's failure storm against another job's detection.

An embedded control plane (nats-server, redis-server) and the real services, each its own
process as deployed (``trainguard service NAME``, default settings): two detector replicas
(``det-a``, ``det-b``: they split the jobs by per-job leases and rendezvous hashing), the
diagnoser, the remediator and the bridge (webhook to a local HTTP receiver). ``--jobs``
simulated jobs (default 64) of ``--hosts`` x ``--per-host`` ranks (default 32 x 8 = 256),
built from :mod:`bench_fleet`'s parts: every rank's hello, its heartbeat and step report
once a ``--beat-every`` seconds at its own phase, an agent per host beating once a second,
agents acknowledging commands; all of it from this one process over one NATS connection
(:func:`bench_fleet.drive`, which records how late each slot of beats went out: the
generator's lag).

After ``--warmup`` (every job owned by a detector; the split is reported), the runs
alternate, ``--repeat`` times each, on the same servers:

* ``alone``: one rank of a probe job crashes (its agent's ``WorkerExit``, exit code 1; the
  rank falls silent, its peers stall in a collective), nothing else fails;
* ``storm``: the same probe fault at the same moment as a crash storm in another job: the
  ranks of ``--storm-hosts`` of its hosts (default 16) exit at once (a ``WorkerExit``
  each), those hosts fall silent and the rest of that job stalls (a hang).

Each run uses fresh jobs, picked so that the probe job is owned by the storm job's
detector in half the repetitions and by the other detector in the rest (both columns use
the same picks). ``--probe hang`` makes the probe fault a hang of one rank (it stays in
``compute`` while the others wait in ``comm``; detected at the hang limit, 3 x the p99 step
interval) instead of a crash.

Reported per run: the probe's detection latency (fault onset, as this process publishes
it, to its first anomaly on the bus, as this process receives it; beside it the onset to
the anomaly's ``detected_at`` and to the exit report stored by the stream) and whether that
anomaly names the right rank; p50 and p99 over the repetitions; the storm job's crashes
and when the last was reported; anomalies after the warm-up in the jobs that never failed
(false ones); CPU of each service process, nats-server, redis-server and this generator
during each run (``/proc/<pid>/stat``, as a share of one core); messages a second through
this process's NATS connection; the generator's lag; the detectors' bus stalls (their
logs). ``--logs DIR`` keeps the services' logs.

Run (the target's size, 64 jobs of 32 x 8 ranks, a beat every 4 s; about 4 minutes, most
of it the 16,384 ranks' hellos): ``.venv/bin/python bench/bench_jobs.py [--repeat 3]
[--out results.json]``. On a small machine the one generator process cannot carry that
many ranks: the report says so (the generator's lag, false ``unresponsive`` anomalies in
healthy jobs); the size that holds on 2 cores, about 1.5 minutes:
``--hosts 8 --storm-hosts 6 --beat-every 2 --repeat 8`` (64 jobs of 64 ranks).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fleet import Fleet, Pages, Seen, Shape, connect, drive, table, watch

from trainguard.contract.envelope import uuid7
from trainguard.contract.schemas import WorkerExit
from trainguard.runtime.embedded import EmbeddedControlPlane
from trainguard.runtime.state import Keys

PREFIX = "jobs"
DETECTORS = ("det-a", "det-b")
SERVICES = {"det-a": "detector", "det-b": "detector", "diagnoser": "diagnoser",
            "remediator": "remediator", "bridge": "bridge"}
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


class Services:
    """The services as subprocesses (``python -m trainguard service NAME``), logs in ``tmp``.

    ``services`` maps each process's name to its service (a detector's name is its
    ``instance_id``); ``env`` adds settings to every process. A process killed
    (:meth:`kill`) can be started again (:meth:`spawn`), its log going on in the same file.
    """

    def __init__(self, plane: EmbeddedControlPlane, tmp: Path, webhook: str,
                 services: dict[str, str] | None = None, prefix: str = PREFIX,
                 env: dict[str, str] | None = None) -> None:
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}
        self.services = SERVICES if services is None else services
        self.tmp, self.webhook = tmp, webhook
        self.root = Path(__file__).resolve().parents[1]
        self.base = {**os.environ, "TRAINGUARD_NATS_URL": plane.nats.url,
                     "TRAINGUARD_REDIS_URL": plane.redis.url, "TRAINGUARD_PREFIX": prefix,
                     "PYTHONPATH": os.pathsep.join([str(self.root / "libs"),
                                                    os.environ.get("PYTHONPATH", "")]),
                     **(env or {})}
        for name in self.services:
            self.spawn(name)

    def spawn(self, name: str) -> None:
        service = self.services[name]
        env = dict(self.base)
        if service == "detector":
            env["TRAINGUARD_INSTANCE_ID"] = name
        if service == "bridge":
            env["TRAINGUARD_WEBHOOK_URL"] = self.webhook
        self.logs[name] = self.tmp / f"{name}.log"
        with self.logs[name].open("ab") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "trainguard", "service", service], env=env,
                stdout=log, stderr=subprocess.STDOUT, cwd=str(self.root))

    def kill(self, name: str) -> None:
        """SIGKILL ``name``: no clean stop, its leases stay until they expire."""
        self.procs[name].kill()
        self.procs[name].wait()

    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.procs.items()}

    def check(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None and p.returncode != -signal.SIGKILL:
                raise RuntimeError(f"{name} exited ({p.returncode}):\n"
                                   + self.logs[name].read_text()[-3000:])

    def count(self, name: str, text: str) -> int:
        return self.logs[name].read_text(errors="replace").count(text)

    def keep(self, folder: str) -> None:
        """Copy the logs to ``folder`` (nothing if empty)."""
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            for log in self.logs.values():
                shutil.copy(log, Path(folder) / log.name)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class Cpu:
    """CPU seconds of named processes between two readings."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.at = self.read()

    def read(self) -> dict[str, float]:
        out = {name: cpu_s(pid) for name, pid in self.pids.items()}
        out["generator"] = time.process_time()
        return out

    def since(self) -> dict[str, float]:
        now = self.read()
        return {k: round(now[k] - self.at[k], 2) for k in now}


@dataclass
class Plan:
    """One run: which job fails how."""

    setup: str  # "alone" or "storm"
    probe: str
    rank: int
    storm: str | None
    same_detector: bool


@dataclass
class Outcome:
    plan: Plan
    detection_s: float | None = None
    raised_s: float | None = None
    stored_s: float | None = None
    """Onset to the probe's exit report stored by the stream (its publish acknowledged)."""
    """Onset to the anomaly's ``detected_at`` (the detector's clock: this machine's)."""
    named_right: bool = False
    kind: str = ""
    storm_anomalies: int = 0
    storm_crashes: int = 0
    storm_last_crash_s: float | None = None
    cpu: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    msgs_out: int = 0
    msgs_in: int = 0
    lag_p99_s: float = 0.0
    lag_max_s: float = 0.0


def plans(jobs: list[str], owner: dict[str, str], repeat: int,
          shape: Shape) -> Iterator[Plan]:
    """``alone`` and ``storm`` runs interleaved, each on fresh jobs: a storm job, and a probe
    job of the storm job's detector in even repetitions, of the other in odd ones."""
    free = list(jobs[1:])  # job 0 stays healthy whatever the picks

    def take(det: str | None = None, not_det: str | None = None) -> str:
        for j in free:
            if (det is None or owner[j] == det) and (not_det is None or owner[j] != not_det):
                free.remove(j)
                return j
        raise RuntimeError("not enough jobs for the runs (raise --jobs or lower --repeat)")

    for k in range(repeat):
        storm = take()
        same = k % 2 == 0
        rank = (shape.ranks // 2) + k  # on a host the storm job would not lose
        for setup in ("alone", "storm"):
            probe = take(det=owner[storm]) if same else take(not_det=owner[storm])
            yield Plan(setup, probe, rank, storm if setup == "storm" else None, same)


def exit_of(fleet: Fleet, rank: int, now: float) -> WorkerExit:
    shape = fleet.shape
    return WorkerExit(id=uuid7(), job=fleet.job, host=shape.host(rank), rank=rank,
                      local_rank=rank % shape.per_host, pid=100_000 + rank, exit_code=1,
                      error="RuntimeError: CUDA error: an illegal memory access",
                      time=now)


async def crash(fleet: Fleet, ranks: list[int], hosts: frozenset[str] = frozenset()) -> float:
    """``ranks`` exit (their agents' reports) and fall silent with ``hosts``; the rest of
    the job stalls in a collective. Returns when the stream had stored every report."""
    now = time.time()
    fleet.silent_ranks.update(ranks)
    fleet.silent = fleet.silent | hosts
    fleet.stall()
    s = fleet.bus.subjects
    await asyncio.gather(*(fleet.bus.publish_durable(
        s.exit(fleet.job, fleet.shape.host(r)), exit_of(fleet, r, now)) for r in ranks))
    return time.time()


async def one(plan: Plan, fleets: dict[str, Fleet], seen: Seen, probe_kind: str,
              storm_hosts: int, observe: float, nc: Any, cpu: Cpu,
              lag: list[float]) -> Outcome:
    out = Outcome(plan)
    probe = fleets[plan.probe]
    before = set(seen.anomalies)
    cpu.at = cpu.read()
    msgs = nc.stats["out_msgs"], nc.stats["in_msgs"]
    lag_from = len(lag)
    started = time.monotonic()
    faults: list[Awaitable[float | None]] = []
    if plan.storm is not None:
        storm = fleets[plan.storm]
        hosts = frozenset(f"host-{h}" for h in range(storm_hosts))
        lost = [r for r in range(storm.shape.ranks) if storm.shape.host(r) in hosts]
        faults.append(crash(storm, lost, hosts))
    onset = time.time()
    if probe_kind == "crash":
        faults.append(crash(probe, [plan.rank]))
    else:
        probe.stall(holders=[plan.rank])
        onset = probe.stalled_at or onset
        faults.append(asyncio.sleep(0, None))
    stored = (await asyncio.gather(*faults))[-1]
    if stored is not None:
        out.stored_s = round(stored - onset, 3)
    deadline = time.monotonic() + observe
    first = None
    while time.monotonic() < deadline:
        mine = sorted((t, a) for i, (t, a) in seen.anomalies.items()
                      if i not in before and a.job == plan.probe)
        if mine:
            first = mine[0]
            break
        await asyncio.sleep(0.02)
    quiet = time.monotonic()  # the storm's aftermath, inside this run's CPU window
    count = len(seen.anomalies)
    while time.monotonic() - quiet < 2.0 and time.monotonic() < deadline + 30:
        await asyncio.sleep(0.1)
        if len(seen.anomalies) != count:
            count, quiet = len(seen.anomalies), time.monotonic()
    out.wall_s = round(time.monotonic() - started, 2)
    out.cpu = cpu.since()
    out.msgs_out = nc.stats["out_msgs"] - msgs[0]
    out.msgs_in = nc.stats["in_msgs"] - msgs[1]
    late = sorted(lag[lag_from:]) or [0.0]
    out.lag_p99_s = round(late[int(0.99 * (len(late) - 1))], 3)
    out.lag_max_s = round(late[-1], 3)
    if first is not None:
        t, a = first
        out.detection_s = round(t - onset, 3)
        out.raised_s = round(a.detected_at - onset, 3)
        out.named_right = a.ranks == [plan.rank]
        out.kind = a.kind
    if plan.storm is not None:
        storm_seen = [(t, a) for i, (t, a) in seen.anomalies.items()
                      if i not in before and a.job == plan.storm]
        out.storm_anomalies = len(storm_seen)
        crashes = sorted(t for t, a in storm_seen if a.kind == "crash")
        out.storm_crashes = len(crashes)
        out.storm_last_crash_s = round(crashes[-1] - onset, 2) if crashes else None
    return out


async def owners(redis_url: str, jobs: list[str]) -> dict[str, str | None]:
    r = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        values = await r.mget([Keys(PREFIX).lease("detector", j) for j in jobs])
    finally:
        await r.aclose()
    return dict(zip(jobs, values, strict=True))


async def registered(redis_url: str) -> int:
    r = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        return int(await r.zcard(f"{PREFIX}:detector:instances"))
    finally:
        await r.aclose()


async def bench(args: argparse.Namespace, plane: EmbeddedControlPlane,
                tmp: Path) -> dict[str, Any]:
    shape = Shape(hosts=args.hosts, per_host=args.per_host, per_switch=args.hosts,
                  beat_every=args.beat_every)
    pages = Pages()
    nc, bus = await connect(plane, PREFIX)
    services = Services(plane, tmp, f"{pages.url}/ce")
    stop = asyncio.Event()
    lag: list[float] = []
    sim: asyncio.Task[None] | None = None
    try:
        for _ in range(600):
            services.check()
            if await registered(plane.redis.url) >= len(DETECTORS):
                break
            await asyncio.sleep(0.1)
        else:
            raise RuntimeError("the detectors did not register")
        await asyncio.sleep(2.0)  # their consumers bound
        names = [f"job-{i:02d}" for i in range(args.jobs)]
        fleets = {j: Fleet(bus, j, shape, gone=frozenset()) for j in names}
        seen = Seen()
        await watch(nc, PREFIX, "*", seen)
        for fleet in fleets.values():
            await fleet.acks(nc)
        t = time.monotonic()
        sim = asyncio.create_task(drive(list(fleets.values()), stop, shape.beat_every, lag))
        for fleet in fleets.values():
            await fleet.hello()
        hellos_s = time.monotonic() - t
        for _ in range(1200):
            services.check()
            owner = await owners(plane.redis.url, names)
            if all(owner.values()):
                break
            await asyncio.sleep(0.25)
        else:
            raise RuntimeError(f"jobs not owned: {[j for j, o in owner.items() if not o]}")
        owned_s = time.monotonic() - t
        split = {d: sum(1 for o in owner.values() if o == d) for d in DETECTORS}
        print(f"{args.jobs} jobs x {shape.ranks} ranks: hellos sent in {hellos_s:.1f} s, "
              f"every job owned after {owned_s:.1f} s, split {split}", flush=True)
        await asyncio.sleep(args.warmup)
        warm = len(seen.anomalies)
        measured_from = time.time()
        cpu = Cpu({**services.pids(), "nats-server": plane.nats.pid or 0,
                   "redis-server": plane.redis.pid or 0})
        total = Cpu(cpu.pids)
        stalls0 = {d: services.count(d, "no answer from the NATS server") for d in DETECTORS}
        t_meas = time.monotonic()
        outcomes = []
        for plan in plans(names, {j: str(o) for j, o in owner.items()}, args.repeat, shape):
            services.check()
            o = await one(plan, fleets, seen, args.probe, args.storm_hosts, args.observe,
                          nc, cpu, lag)
            outcomes.append(o)
            print(f"{plan.setup:5} probe {plan.probe} ({owner[plan.probe]}, "
                  f"{'same' if plan.same_detector else 'other'} detector as storm job) "
                  f"rank {plan.rank}: {o.kind or 'nothing'} after {o.detection_s} s, "
                  f"named right {o.named_right}; lag p99 {o.lag_p99_s} s; cpu {o.cpu}",
                  flush=True)
        measured_s = time.monotonic() - t_meas
        whole = total.since()
        failed = {p for o in outcomes for p in (o.plan.probe, o.plan.storm) if p}
        false = [(round(t - measured_from, 1), a.job, a.kind, a.ranks[:4])
                 for t, a in sorted(seen.anomalies.values(), key=lambda x: x[0])
                 if a.job not in failed and t >= measured_from]
        stalls = {d: services.count(d, "no answer from the NATS server") - stalls0[d]
                  for d in DETECTORS}
    finally:
        await wind_down(stop, sim, services, args.logs)
        pages.server.shutdown()
        await nc.close()
    return {"jobs": args.jobs, "hosts": shape.hosts, "per_host": shape.per_host,
            "ranks_per_job": shape.ranks, "ranks": shape.ranks * args.jobs,
            "beat_every_s": shape.beat_every, "probe": args.probe,
            "storm_ranks": args.storm_hosts * shape.per_host,
            "hellos_s": round(hellos_s, 1), "owned_s": round(owned_s, 1), "split": split,
            "anomalies_during_warmup": warm, "false_anomalies": len(false),
            "false_examples": false[:10], "bus_stalls": stalls,
            "measured_s": round(measured_s, 1),
            "cpu_s": whole, "cpu_core_pct": {k: round(100 * v / measured_s, 1)
                                             for k, v in whole.items()},
            "runs": [{"setup": o.plan.setup, "probe_job": o.plan.probe,
                      "probe_owner": owner[o.plan.probe], "storm_job": o.plan.storm,
                      "same_detector": o.plan.same_detector, "detection_s": o.detection_s,
                      "raised_s": o.raised_s, "stored_s": o.stored_s,
                      "named_right": o.named_right, "kind": o.kind,
                      "storm_anomalies": o.storm_anomalies,
                      "storm_crashes": o.storm_crashes,
                      "storm_last_crash_s": o.storm_last_crash_s, "cpu_s": o.cpu,
                      "wall_s": o.wall_s,
                      "msgs_per_s": round((o.msgs_out + o.msgs_in) / o.wall_s),
                      "lag_p99_s": o.lag_p99_s, "lag_max_s": o.lag_max_s}
                     for o in outcomes]}


def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 2) if xs else None


def report(r: dict[str, Any]) -> None:
    load = os.getloadavg()
    print(f"\nload: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (1/5/15 min) on "
          f"{os.cpu_count()} cores")
    print(f"{r['jobs']} jobs x {r['ranks_per_job']} ranks ({r['ranks']:,} ranks), beat every "
          f"{r['beat_every_s']:g} s; jobs split {r['split']}; every job owned "
          f"{r['owned_s']} s after the hellos began; probe: {r['probe']}")
    runs = r["runs"]
    setups = ("alone", "storm")
    by = {s: [x for x in runs if x["setup"] == s] for s in setups}

    def col(s: str, fn: Any) -> str:
        return fn(by[s])

    def lat(xs: list[dict[str, Any]]) -> list[float]:
        return [x["detection_s"] for x in xs if x["detection_s"] is not None]

    def cpu(name: str) -> Any:
        return lambda xs: round(statistics.mean(x["cpu_s"][name] / x["wall_s"] * 100
                                                for x in xs), 1)

    rows: list[tuple[str, Any]] = [
        ("probe detection, each run (s)", [col(s, lambda xs: " / ".join(
            f"{x['detection_s']}" + ("" if x["same_detector"] else "*") for x in xs))
            for s in setups]),
        ("of which onset -> raised by the detector (s)", [col(s, lambda xs: " / ".join(
            f"{x['raised_s']}" for x in xs)) for s in setups]),
        ("of which onset -> the exit stored by the stream (s)", [col(s, lambda xs: " / ".join(
            f"{x['stored_s']}" for x in xs)) for s in setups]),
        ("p50 / p99 (s)", [col(s, lambda xs: f"{pct(lat(xs), 0.5)} / {pct(lat(xs), 0.99)}")
                           for s in setups]),
        ("named the right rank", [col(s, lambda xs: f"{sum(x['named_right'] for x in xs)} "
                                                    f"of {len(xs)}") for s in setups]),
        ("anomalies in the storm job", [col(s, lambda xs: " / ".join(
            str(x["storm_anomalies"]) for x in xs)) for s in setups]),
        ("storm: crashes reported / the last one after (s)", [col(s, lambda xs: " / ".join(
            f"{x['storm_crashes']} in {x['storm_last_crash_s']}" for x in xs)) for s in setups]),
        ("messages a second through NATS (this client)", [col(s, lambda xs: round(
            statistics.mean(x["msgs_per_s"] for x in xs))) for s in setups]),
        ("generator lag, p99 / max (s)", [col(s, lambda xs: f"{max(x['lag_p99_s'] for x in xs)}"
                                                          f" / {max(x['lag_max_s'] for x in xs)}")
                                          for s in setups]),
    ]
    for name in [*SERVICES, "nats-server", "redis-server", "generator"]:
        rows.append((f"CPU {name} (% of a core)", [col(s, cpu(name)) for s in setups]))
    table("probe job's detection (* probe owned by the other detector)",
          ["alone", "storm"], rows)
    print(f"\nfalse anomalies (jobs that never failed, after the warm-up): "
          f"{r['false_anomalies']} {r['false_examples']}; "
          f"anomalies during warm-up: {r['anomalies_during_warmup']}; "
          f"detectors' bus stalls: {r['bus_stalls']}")
    alone, storm = lat(by["alone"]), lat(by["storm"])
    if alone and storm:
        worst = max(s - a for s, a in zip(storm, alone, strict=False))
        print(f"storm slower than alone (pairwise, worst): {worst:.2f} s; "
              f"p99 difference {pct(storm, 0.99) - pct(alone, 0.99):.2f} s")  # type: ignore[operator]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=64)
    ap.add_argument("--hosts", type=int, default=32, help="hosts of each job")
    ap.add_argument("--per-host", type=int, default=8)
    ap.add_argument("--beat-every", type=float, default=4.0,
                    help="seconds between a rank's heartbeats and step reports")
    ap.add_argument("--storm-hosts", type=int, default=16,
                    help="hosts of the storm job whose ranks all exit at once")
    ap.add_argument("--probe", choices=("crash", "hang"), default="crash")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--warmup", type=float, default=10.0,
                    help="seconds after every job is owned before the first run")
    ap.add_argument("--observe", type=float, default=20.0,
                    help="longest wait for the probe's anomaly")
    ap.add_argument("--out", default="")
    ap.add_argument("--logs", default="", help="a folder to keep the services' logs in")
    return on_a_plane(bench, report, ap.parse_args())


async def wind_down(stop: asyncio.Event, sim: asyncio.Task[None] | None, services: Services,
                    logs: str) -> None:
    """Stop the simulated fleet (``sim``, driven until ``stop``) and the services, keeping
    their logs in ``logs`` (if given)."""
    stop.set()
    if sim is not None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(sim, 10)
    services.stop()
    services.keep(logs)


def on_a_plane(bench: Callable[[argparse.Namespace, EmbeddedControlPlane, Path],
                               Awaitable[dict[str, Any]]],
               report: Callable[[dict[str, Any]], None], args: argparse.Namespace) -> int:
    """Run ``bench`` on a fresh embedded control plane (its files in a temporary folder),
    print its ``report`` and write the result to ``--out``."""
    with tempfile.TemporaryDirectory() as tmp:
        plane = EmbeddedControlPlane(Path(tmp) / "plane").start()
        try:
            result = asyncio.run(bench(args, plane, Path(tmp)))
        finally:
            plane.stop()
    report(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
