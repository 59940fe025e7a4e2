"""Failover at scale: how long a job goes unwatched when a detector replica or the
remediator leader is SIGKILLed (issue 34; target: at most 5 s at 16,384 ranks).

An embedded control plane (nats-server, redis-server) and the real services, each its own
process (:class:`bench_jobs.Services`): two detector replicas (``det-a``, ``det-b``), the
diagnoser, and two remediators (``rem-a``, ``rem-b``: one leads, one stands by). One
simulated job of ``--ranks`` ranks (8 a host) from :mod:`bench_fleet`'s parts: every
rank's hello, its heartbeat and step report once a ``--beat-every`` seconds, an agent per
host beating once a second and acknowledging commands, all from this one process.

Each repetition (``--repeat``) runs three phases on the same servers, a crash of one rank
each (its agent's ``WorkerExit``; the rank falls silent, its peers stall in a collective;
every phase on another host, so each is its own incident):

* ``baseline``: the crash alone;
* ``detector``: the detector that owns the job (its lease) is SIGKILLed, and the crash
  follows at once; the survivor must take the job over to see it;
* ``remediator``: the leader is SIGKILLed, and the crash follows at once; the standby must
  take the lead to decide on it.

Reported per phase: onset (the crash, right after the kill) to the crash's anomaly on the
bus (detection) and to the first incident revision with a plan (the decision); for the
kill phases the kill to the new holder's lease or leader lock in Redis (the takeover:
the blind window's own part, before the fault's detection, which the baseline shows) and
the survivor's state reload (its log: milliseconds, values and bytes read). A killed
process is started again before the next phase (the detector under its name).

Run (default: 256 ranks, about a minute): ``.venv/bin/python bench/bench_failover.py``;
the target's size: ``--ranks 16384 --beat-every 4 --repeat 3 --settle 8``.
``--peer-probe 0`` turns the detectors' presence probe off (a dead owner's jobs wait for
its leases to expire).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fleet import Fleet, Seen, Shape, connect, drive, table, watch
from bench_jobs import Services, crash, on_a_plane, pct, wind_down

from trainguard.runtime.embedded import EmbeddedControlPlane
from trainguard.runtime.state import Keys

PREFIX = "failover"
JOB = "llm"
DETECTORS = ("det-a", "det-b")
REMEDIATORS = ("rem-a", "rem-b")
SERVICES = {"det-a": "detector", "det-b": "detector", "diagnoser": "diagnoser",
            "rem-a": "remediator", "rem-b": "remediator"}
PHASES = ("baseline", "detector", "remediator")
ADOPTED = re.compile(r"detector (\S+) owns job (\S+) \(\d+ open anomalies; its state read "
                     r"in (\d+) ms: (\d+) values, (\d+) bytes\)")
EPOCH = re.compile(r"leading with epoch (\d+)")
LEADING = re.compile(r"leading with epoch \d+ \((\d+) open incidents read in (\d+) ms\)")


@dataclass
class Phase:
    """One phase's figures (seconds from the onset or the kill; None: not seen)."""

    phase: str
    rank: int
    killed: str = ""
    survivor: str = ""
    takeover_s: float | None = None
    detection_s: float | None = None
    decision_s: float | None = None
    reload_ms: float | None = None
    reload_values: int | None = None
    reload_bytes: int | None = None


class Plane:
    """The services, the job and what came out on the bus."""

    def __init__(self, services: Services, fleet: Fleet, seen: Seen, redis: Any) -> None:
        self.services, self.fleet, self.seen, self.redis = services, fleet, seen, redis
        self.keys = Keys(PREFIX)

    async def owner(self) -> str | None:
        value = await self.redis.get(self.keys.lease("detector", JOB))
        return value.decode() if isinstance(value, bytes) else value

    async def leader(self) -> str | None:
        value = await self.redis.get(self.keys.leader("remediator"))
        return value.decode() if isinstance(value, bytes) else value

    def leading(self) -> str:
        """The remediator process that leads: of the live ones, the one whose log names the
        highest epoch (each new leader draws a higher one; a restarted process's log goes
        on in the same file, after its predecessor's lines)."""
        epochs = {name: max(map(int, EPOCH.findall(
            self.services.logs[name].read_text(errors="replace"))), default=0)
            for name in REMEDIATORS if self.services.procs[name].poll() is None}
        best = max(epochs, key=lambda n: epochs[n], default="")
        if not best or not epochs[best]:
            raise RuntimeError("no remediator leads")
        return best

    async def changed(self, read: Any, old: str | None, started: float,
                      timeout: float) -> float | None:
        """Seconds from ``started`` until ``read()`` names a holder other than ``old``."""
        while time.time() - started < timeout:
            now = await read()
            if now is not None and now != old:
                return round(time.time() - started, 3)
            await asyncio.sleep(0.02)
        return None

    async def fault(self, out: Phase, onset: float, observe: float) -> None:
        """Crash ``out.rank``; wait for its anomaly and its incident's plan."""
        fleet, seen = self.fleet, self.seen
        host = fleet.shape.host(out.rank)
        await crash(fleet, [out.rank])
        deadline = time.time() + observe
        while time.time() < deadline and (out.detection_s is None or out.decision_s is None):
            found = [t for t, a in seen.anomalies.values() if t >= onset
                     and a.kind == "crash" and out.rank in a.ranks]
            if found and out.detection_s is None:
                out.detection_s = round(min(found) - onset, 3)
            plans = [t for revs in seen.incidents.values() for t, inc in revs
                     if t >= onset and inc.actions and host in inc.hosts]
            if plans and out.decision_s is None:
                out.decision_s = round(min(plans) - onset, 3)
            await asyncio.sleep(0.02)
        fleet.stalled_at = None  # the job steps on for the next phase (the rank stays gone)


async def registered(redis: Any, prefix: str) -> int:
    return int(await redis.zcard(f"{prefix}:detector:instances"))


async def until(what: Any, timeout: float, why: str) -> None:
    deadline = time.monotonic() + timeout
    while not await what():
        if time.monotonic() > deadline:
            raise RuntimeError(why)
        await asyncio.sleep(0.1)


async def phase(plane: Plane, name: str, rank: int, observe: float) -> Phase:
    out = Phase(name, rank)
    services = plane.services
    takeover: asyncio.Task[float | None] | None = None
    if name == "detector":
        old = await plane.owner()
        assert old in DETECTORS, f"the job's lease names {old!r}"
        out.killed = old
        services.kill(old)
        onset = time.time()
        takeover = asyncio.create_task(plane.changed(plane.owner, old, onset, observe))
    elif name == "remediator":
        out.killed = plane.leading()
        old = await plane.leader()
        services.kill(out.killed)
        onset = time.time()
        takeover = asyncio.create_task(plane.changed(plane.leader, old, onset, observe))
    else:
        onset = time.time()
    await plane.fault(out, onset, observe)
    if takeover is not None:
        out.takeover_s = await takeover
    if name == "detector":
        out.survivor = next(d for d in DETECTORS if d != out.killed)
        found = ADOPTED.findall(services.logs[out.survivor].read_text(errors="replace"))
        mine = [m for m in found if m[0] == out.survivor and m[1] == JOB]
        if mine:
            out.reload_ms, out.reload_values, out.reload_bytes = map(int, mine[-1][2:])
    elif name == "remediator":
        out.survivor = next(r for r in REMEDIATORS if r != out.killed)
        found = LEADING.findall(services.logs[out.survivor].read_text(errors="replace"))
        if found:
            out.reload_values, out.reload_ms = int(found[-1][0]), int(found[-1][1])
    if out.killed:
        services.spawn(out.killed)  # back to two replicas for the next phase
        if name == "detector":
            await until(lambda: _two(plane), 60, f"{out.killed} did not register again")
    return out


async def _two(plane: Plane) -> bool:
    plane.services.check()
    return await registered(plane.redis, PREFIX) >= len(DETECTORS)


async def bench(args: argparse.Namespace, plane_: EmbeddedControlPlane,
                tmp: Path) -> dict[str, Any]:
    shape = Shape(hosts=args.ranks // 8, per_host=8, per_switch=args.ranks // 8,
                  beat_every=args.beat_every)
    if shape.hosts < 3 * args.repeat + 2:
        raise SystemExit(f"--ranks {args.ranks}: too few hosts for {args.repeat} "
                         "repetitions (a host per phase)")
    redis = aioredis.Redis.from_url(plane_.redis.url, decode_responses=True)
    nc, bus = await connect(plane_, PREFIX)
    env = {} if args.peer_probe is None else \
        {"TRAINGUARD_PEER_PROBE_INTERVAL": str(args.peer_probe)}
    services = Services(plane_, tmp, "", SERVICES, PREFIX, env)
    stop = asyncio.Event()
    sim: asyncio.Task[None] | None = None
    lag: list[float] = []
    phases: list[Phase] = []
    try:
        fleet = Fleet(bus, JOB, shape, gone=frozenset())
        plane = Plane(services, fleet, Seen(), redis)
        await until(lambda: _two(plane), 60, "the detectors did not register")
        await watch(nc, PREFIX, JOB, plane.seen)
        await fleet.acks(nc)
        t = time.monotonic()
        sim = asyncio.create_task(drive([fleet], stop, shape.beat_every, lag))
        await fleet.hello()
        hellos_s = time.monotonic() - t

        async def owned() -> bool:
            services.check()
            return await plane.owner() is not None

        await until(owned, 600, "nobody took the job")
        owned_s = time.monotonic() - t
        print(f"{shape.ranks} ranks: hellos sent in {hellos_s:.1f} s, the job owned by "
              f"{await plane.owner()} after {owned_s:.1f} s", flush=True)
        await asyncio.sleep(args.warmup)  # the owner learns the job's steps
        for k in range(args.repeat):
            for n, name in enumerate(PHASES):
                rank = (1 + 3 * k + n) * shape.per_host  # a host of its own
                services.check()
                out = await phase(plane, name, rank, args.observe)
                phases.append(out)
                print(f"{name:10} rank {rank:5}: {asdict(out)}", flush=True)
                await asyncio.sleep(args.settle)
        late = sorted(lag) or [0.0]
    finally:
        await wind_down(stop, sim, services, args.logs)
        await nc.close()
        await redis.aclose()
    return {"ranks": shape.ranks, "hosts": shape.hosts, "beat_every_s": shape.beat_every,
            "hellos_s": round(hellos_s, 1), "owned_s": round(owned_s, 1),
            "lag_p99_s": round(late[int(0.99 * (len(late) - 1))], 3),
            "lag_max_s": round(late[-1], 3), "phases": [asdict(p) for p in phases]}


def report(r: dict[str, Any]) -> None:
    load = os.getloadavg()
    print(f"\nload: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (1/5/15 min) on "
          f"{os.cpu_count()} cores; {r['ranks']:,} ranks ({r['hosts']} hosts), a beat every "
          f"{r['beat_every_s']:g} s; generator lag p99 {r['lag_p99_s']} s, max "
          f"{r['lag_max_s']} s")
    by = {p: [x for x in r["phases"] if x["phase"] == p] for p in PHASES}

    def cells(key: str) -> list[str]:
        out = []
        for p in PHASES:
            xs = [x[key] for x in by[p] if x[key] is not None]
            missed = len(by[p]) - len(xs)
            if p == "baseline" and not xs:
                out.append("-")  # nothing was killed
                continue
            out.append(f"{pct(xs, 0.5)} / {max(xs) if xs else None}"
                       + (f" ({missed} not seen)" if missed else ""))
        return out

    table("failover, p50 / max over the repetitions", list(PHASES), [
        ("kill -> new holder in Redis (s)", cells("takeover_s")),
        ("onset -> crash detected (s)", cells("detection_s")),
        ("onset -> decision (s)", cells("decision_s")),
        ("survivor's state reload (ms)", cells("reload_ms")),
        ("of which values read (detector) / open incidents (remediator)",
         cells("reload_values")),
        ("of which bytes read", cells("reload_bytes")),
    ])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=256, help="ranks of the job (8 a host)")
    ap.add_argument("--beat-every", type=float, default=1.0,
                    help="seconds between a rank's heartbeats and step reports")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--warmup", type=float, default=8.0,
                    help="seconds after the job is owned before the first phase")
    ap.add_argument("--observe", type=float, default=30.0,
                    help="longest wait for a phase's detection and decision")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds between phases")
    ap.add_argument("--peer-probe", type=float, default=None,
                    help="the detectors' peer_probe_interval (0: a dead owner's jobs wait "
                         "for its leases to expire, as before the presence probe)")
    ap.add_argument("--out", default="")
    ap.add_argument("--logs", default="", help="a folder to keep the services' logs in")
    return on_a_plane(bench, report, ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())
