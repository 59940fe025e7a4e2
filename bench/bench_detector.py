"""Detector: sustained ingest on one core, and detection latency at 1,000 and 10,000 ranks.

1. Ingest: N simulated ranks each send 1 heartbeat + 1 step report per second. Their
   MessagePack bytes go through exactly what the service's subscription callback runs
   (``decode_telemetry`` then ``DetectorService.on_telemetry``: ownership check, rules),
   plus the service's timers (a tick every 0.25 s, a progress summary every second), with
   no network. Pinned to one core. Result: messages per second of wall time.
2. Latency: onset to anomaly in simulated time for crash, hang and straggler, at 1,000
   and 10,000 ranks (steps of ~1 s), and the wall time of the tick that caught the hang.
3. A cProfile top-10 of the ingest loop.

Run: ``.venv/bin/python bench/bench_detector.py [--out results.json] [--quick]``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import os
import pstats
import random
import sys
import time
from typing import Any

from trainguard.contract.codec import decode_telemetry, encode_telemetry
from trainguard.contract.schemas import Heartbeat, StepReport, WorkerExit
from trainguard.runtime.config import load_settings
from trainguard.runtime.service import Metrics
from trainguard.runtime.state import encode_progress
from trainguard.services.detector.service import DetectorService
from trainguard.services.detector.settings import DetectorSettings
from trainguard.services.detector.synthetic import Harness, SimConfig
from trainguard.services.detector.thresholds import Thresholds

JOB = "bench"
START = 1_700_000_000.0


def pin_to_one_core() -> str:
    try:
        cpu = sorted(os.sched_getaffinity(0))[-1]
        os.sched_setaffinity(0, {cpu})
        return f"cpu {cpu}"
    except (AttributeError, OSError):
        return "unpinned"


def second_of_traffic(ranks: int, second: int, rng: random.Random) -> list[tuple[float, bytes]]:
    """One simulated second: every rank's heartbeat and step report, encoded, in time order."""
    t0 = START + second
    out: list[tuple[float, bytes]] = []
    for r in range(ranks):
        hb_t = t0 + (r % 100) / 100.0
        out.append((hb_t, encode_telemetry(Heartbeat(
            job=JOB, time=hb_t, seq=2 * second, rank=r, host=f"node-{r // 8}", pid=1000 + r,
            step=second, phase="compute", phase_elapsed=0.3, coll_seq=second, coll_done=second))))
        compute = 0.8 * math.exp(rng.gauss(0.0, 0.05))
        st_t = t0 + 0.95 + rng.random() * 0.01
        out.append((st_t, encode_telemetry(StepReport(
            job=JOB, time=st_t, seq=2 * second + 1, rank=r, step=second, duration=0.95,
            phases={"data": 0.01, "compute": compute, "comm": 0.94 - compute},
            loss=2.5 + rng.gauss(0.0, 0.02), grad_norm=1.0, tokens=4096, samples=8))))
    out.sort(key=lambda x: x[0])
    return out


def bench_ingest(ranks: int, seconds: int, profile: bool = False,
                 with_metrics: bool = False) -> dict[str, Any]:
    """``with_metrics`` adds the runtime's per-message Prometheus counter, as its
    subscription callback does (decode, count, hand to the service)."""
    settings = load_settings(DetectorSettings, env={})
    svc = DetectorService(settings)
    counter = Metrics("detector").telemetry
    clock = [START]
    svc.detector.clock = lambda: clock[0]
    svc.owned.add(JOB)
    rng = random.Random(7)
    traffic = [second_of_traffic(ranks, s, rng) for s in range(seconds)]
    subject = f"tg.{JOB}.hb.0"
    on_telemetry = svc.on_telemetry
    detector = svc.detector
    profiler = cProfile.Profile() if profile else None
    messages = 0
    tick_time = 0.0
    progress_time = 0.0
    started = time.perf_counter()
    if profiler:
        profiler.enable()
    for s, batch in enumerate(traffic):
        next_tick = START + s + 0.25
        for t, data in batch:
            while t >= next_tick:
                clock[0] = next_tick
                t1 = time.perf_counter()
                detector.tick(next_tick)
                tick_time += time.perf_counter() - t1
                next_tick += 0.25
            clock[0] = t
            msg = decode_telemetry(data)
            if with_metrics:
                counter.labels("detector", "ok").inc()
            on_telemetry(msg, subject)
        messages += len(batch)
        clock[0] = START + s + 1.0
        t1 = time.perf_counter()
        progress = detector.progress(JOB, clock[0])
        assert progress is not None
        encode_progress(progress)
        progress_time += time.perf_counter() - t1
        detector.drain()
    elapsed = time.perf_counter() - started
    if profiler:
        profiler.disable()
    result: dict[str, Any] = {
        "ranks": ranks, "with_runtime_metrics": with_metrics, "seconds_simulated": seconds,
        "messages": messages,
        "wall_s": round(elapsed, 3), "msgs_per_s": round(messages / elapsed),
        "realtime_factor": round(seconds / elapsed, 2),
        "tick_ms": round(1000 * tick_time / (4 * seconds), 3),
        "progress_ms": round(1000 * progress_time / seconds, 3),
        "anomalies": len(detector.outbox),
    }
    if profiler:
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(10)
        result["profile"] = buf.getvalue()
    return result


def sim(ranks: int) -> Harness:
    cfg = SimConfig(job=JOB, ranks=ranks, compute=0.9, jitter=0.05, data=0.01, comm=0.02,
                    slow_step_prob=0.0, seed=3)
    return Harness(Thresholds(), cfg, tick_every=0.25)


def latency_crash(ranks: int) -> dict[str, Any]:
    h = sim(ranks)
    h.sim.steps(10)
    onset = h.clock
    t1 = time.perf_counter()
    h.detector.on_exit(WorkerExit(id="x", job=JOB, host=h.sim.host(7), rank=7, exit_code=1,
                                  time=onset), onset)
    wall = time.perf_counter() - t1
    [crash] = h.collect()
    assert crash.ranks == [7]
    return {"sim_s": round(crash.detected_at - crash.onset_at, 3),
            "handler_ms": round(1000 * wall, 3), "note": "at receipt of the WorkerExit"}


def latency_hang(ranks: int, phase: str, quiet: bool = False) -> dict[str, Any]:
    """One rank stops in ``phase`` (compute: judged by ``hang_floor``; data, an irregular
    phase: by ``unclear_hang_floor``, or by ``hang_floor`` once its beats say it does no
    work there, ``quiet``), the others wait in ``comm``."""
    h = sim(ranks)
    h.sim.steps(60)
    onset = h.job.last_progress
    costs: list[float] = []
    tick = h.tick

    def timed_tick(now: float) -> None:
        t1 = time.perf_counter()
        tick(now)
        costs.append(time.perf_counter() - t1)

    h.sim.tick = timed_tick
    culprit = ranks // 2
    while not h.opened("hang"):
        h.sim.stall(0.25, lambda r: phase if r == culprit else "comm",
                    frozenset({culprit}) if quiet else frozenset())
    [hang] = h.opened("hang")
    assert hang.ranks == [culprit], hang.ranks
    return {"sim_s": round(hang.detected_at - onset, 3), "limit_s": hang.evidence.limit,
            "tick_ms_max": round(1000 * max(costs), 2),
            "tick_ms_median": round(1000 * sorted(costs)[len(costs) // 2], 3)}


def latency_straggler(ranks: int) -> dict[str, Any]:
    h = sim(ranks)
    h.sim.steps(20)
    slow = ranks // 3
    h.sim.slow[slow] = 1.5
    onset_step, onset_t = h.sim.step, h.clock
    while not h.opened("straggler"):
        h.sim.steps(1)
    [alert] = h.opened("straggler")
    assert alert.ranks == [slow], alert.ranks
    assert alert.step is not None
    return {"sim_s": round(alert.detected_at - onset_t, 3),
            "steps": alert.step - onset_step + 1}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--quick", action="store_true", help="shorter runs")
    args = parser.parse_args()
    pinned = pin_to_one_core()
    ingest = [bench_ingest(n, secs, with_metrics=m)
              for n, secs in ((1000, 10 if args.quick else 30), (10_000, 3 if args.quick else 10))
              for m in (False, True)]
    profiled = bench_ingest(1000, 5 if args.quick else 10, profile=True)
    latency = {n: {"crash": latency_crash(n), "hang": latency_hang(n, "compute"),
                   "hang_data": latency_hang(n, "data"),
                   "hang_data_stuck": latency_hang(n, "data", quiet=True),
                   "straggler": latency_straggler(n)}
               for n in (1000, 10_000)}

    print(f"Detector benchmark ({pinned}, Python {sys.version.split()[0]})\n")
    print("| ranks | path | messages | wall s | msgs/s | x real time | tick ms "
          "| progress ms |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in ingest:
        path = "decode + metrics + rules" if r["with_runtime_metrics"] else "decode + rules"
        print(f"| {r['ranks']:,} | {path} | {r['messages']:,} | {r['wall_s']} "
              f"| {r['msgs_per_s']:,} | {r['realtime_factor']} | {r['tick_ms']} "
              f"| {r['progress_ms']} |")
    print("\n| ranks | crash (sim s) | hang in compute (sim s, limit) | hang in data, working "
          "| hang in data, no work | hang tick ms (max) | straggler (sim s, steps) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n, lat in latency.items():
        print(f"| {n:,} | {lat['crash']['sim_s']} | {lat['hang']['sim_s']} "
              f"(limit {lat['hang']['limit_s']}) | {lat['hang_data']['sim_s']} "
              f"(limit {lat['hang_data']['limit_s']}) | {lat['hang_data_stuck']['sim_s']} "
              f"(limit {lat['hang_data_stuck']['limit_s']}) | {lat['hang']['tick_ms_max']} "
              f"| {lat['straggler']['sim_s']} ({lat['straggler']['steps']} steps) |")
    print("\ncProfile, ingest of 1,000 ranks (top 10 by own time):\n")
    print("```")
    print("\n".join(line for line in profiled["profile"].splitlines()[:30]
                    if line.strip()))
    print("```")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"pinned": pinned, "ingest": ingest,
                       "latency": {str(k): v for k, v in latency.items()},
                       "profile_top10": profiled["profile"]}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
