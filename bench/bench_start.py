"""Start cost: process start -> first completed step of a 4-rank gloo job, with and
without trainguard, in one run.

Three trainers, interleaved round by round (the order rotates, so a machine that gets
busier during the run burdens each alike), each a fresh ``torchrun`` job of 4 ranks on
loopback (``trainguard.examples.first_step``):

- ``plain``: torch only, no trainguard import;
- ``trainguard``: ``import trainguard``, Guard, Checkpointer, ``resume()`` against a
  live embedded nats-server (no coordinator: nothing to resume), steps in ``guard.step``;
- ``disabled``: the same trainer with ``TRAINGUARD_DISABLED=1``.

Per job: each rank's process start (from ``/proc``) -> its first step, the job's value
being its slowest rank (a synchronous job's first step is done when every rank's is); and
the launcher's start -> the last rank's first step. Reported: median and spread (min-max)
per mode, and trainguard's extra cost as the median of the per-round differences from
``plain`` (the target: <= 0.2 s, or <= 10% of plain torch's start).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from trainguard.runtime.embedded import NatsServer, free_port

RANKS = 4
MODES = ("plain", "trainguard", "disabled")
TARGET_EXTRA_S = 0.2
TARGET_EXTRA_RATIO = 0.10


def run_job(mode: str, work: Path, nats_url: str, timeout: float) -> dict[str, Any]:
    """One torchrun job; its per-rank records and the launcher-to-first-step time."""
    out = work / f"{mode}-{time.monotonic_ns()}"
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env.update({"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "TRAINGUARD_NATS_URL": nats_url, "TRAINGUARD_JOB": "bench-start"})
    if mode == "disabled":
        env["TRAINGUARD_DISABLED"] = "1"
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
            "--nproc-per-node", str(RANKS), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--local-addr", "127.0.0.1",
            "-m", "trainguard.examples.first_step",
            "--mode", "plain" if mode == "plain" else "trainguard", "--out", str(out)]
    launched = time.time()
    proc = subprocess.run(argv, env=env, cwd=out, capture_output=True, text=True,
                          timeout=timeout, check=False)
    records = [json.loads(f.read_text()) for f in sorted(out.glob("rank-*.json"))]
    if proc.returncode != 0 or len(records) != RANKS:
        tail = (proc.stderr or proc.stdout)[-600:]
        raise RuntimeError(f"{mode} job failed (exit {proc.returncode}, "
                           f"{len(records)}/{RANKS} ranks reported): {tail}")
    if any(r["disabled"] != (mode == "disabled") for r in records):
        raise RuntimeError(f"{mode}: a rank's Guard was not in the mode asked for")
    return {
        "mode": mode,
        "rank_start_to_first_step_s": max(r["first_step"] - r["process_start"]
                                          for r in records),
        "launch_to_first_step_s": max(r["first_step"] for r in records) - launched,
        "imports_s": statistics.median(r["imported"] - r["process_start"] for r in records),
        "pg_init_s": statistics.median(r["pg_ready"] - r["imported"] for r in records),
        "setup_s": statistics.median(r["set_up"] - r["model_ready"] for r in records),
        "step_s": statistics.median(r["first_step"] - r["set_up"] for r in records),
        # trainguard's own share of the start, timed inside the rank: its imports and its
        # set-up (Guard, Checkpointer, resume lookup) after a barrier; 0 for plain torch.
        "own_s": max(r["imported"] - r["torch_imported"] + r["set_up"] - r["model_ready"]
                     for r in records),
    }


def summarize(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    by_mode = {m: [j for j in jobs if j["mode"] == m] for m in MODES}
    keys = ("rank_start_to_first_step_s", "launch_to_first_step_s", "imports_s", "pg_init_s",
            "setup_s", "step_s", "own_s")
    summary: dict[str, Any] = {}
    for mode, js in by_mode.items():
        summary[mode] = {k: {"median": statistics.median(j[k] for j in js),
                             "min": min(j[k] for j in js), "max": max(j[k] for j in js)}
                         for k in keys}
        summary[mode]["runs"] = len(js)
    key = "rank_start_to_first_step_s"
    plain = summary["plain"][key]["median"]
    for mode in ("trainguard", "disabled"):
        diffs = [b[key] - a[key] for a, b in zip(by_mode["plain"], by_mode[mode], strict=True)]
        extra = statistics.median(diffs)
        summary[mode]["extra_s"] = extra
        summary[mode]["extra_spread_s"] = [min(diffs), max(diffs)]
        summary[mode]["extra_ratio"] = extra / plain if plain else None
        summary[mode]["meets_target"] = extra <= TARGET_EXTRA_S or \
            extra <= TARGET_EXTRA_RATIO * plain
    # The same cost timed where it is spent (far less noisy than a difference of two
    # 10-second starts on a busy machine): trainguard's imports and set-up, plus what its
    # first step took beyond plain torch's.
    tg = summary["trainguard"]
    direct = tg["own_s"]["median"] + max(
        0.0, tg["step_s"]["median"] - summary["plain"]["step_s"]["median"])
    tg["direct_extra_s"] = direct
    tg["direct_meets_target"] = direct <= TARGET_EXTRA_S or direct <= TARGET_EXTRA_RATIO * plain
    return summary


def table(summary: dict[str, Any]) -> str:
    def cell(stats: dict[str, float]) -> str:
        return f"{stats['median']:.2f} s ({stats['min']:.2f}-{stats['max']:.2f})"

    out = ["| trainer | rank start -> first step | launcher -> first step | imports | "
           "process group | Guard + Checkpointer + resume | first step | "
           "trainguard's own time (slowest rank) | extra vs plain (median of rounds) |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for mode in MODES:
        s = summary[mode]
        extra = "-"
        if mode != "plain":
            lo, hi = s["extra_spread_s"]
            extra = f"{s['extra_s']:+.2f} s ({lo:+.2f}..{hi:+.2f}), {100 * s['extra_ratio']:+.0f}%"
        out.append(f"| {mode} | {cell(s['rank_start_to_first_step_s'])} | "
                   f"{cell(s['launch_to_first_step_s'])} | {cell(s['imports_s'])} | "
                   f"{cell(s['pg_init_s'])} | {cell(s['setup_s'])} | {cell(s['step_s'])} | "
                   f"{cell(s['own_s'])} | {extra} |")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write results as JSON here")
    p.add_argument("--rounds", type=int, default=5, help="jobs per trainer (default 5)")
    p.add_argument("--quick", action="store_true", help="3 rounds")
    p.add_argument("--timeout", type=float, default=300.0, help="bound of one job (s)")
    args = p.parse_args()
    rounds = 3 if args.quick else args.rounds
    if rounds < 1:
        p.error("--rounds must be >= 1")
    started = time.time()
    jobs: list[dict[str, Any]] = []
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-start-") as tmp:
        work = Path(tmp)
        nats = NatsServer(free_port(), work / "nats")
        nats.start()
        try:
            for i in range(rounds):
                order = MODES[i % len(MODES):] + MODES[:i % len(MODES)]
                for mode in order:
                    print(f"round {i + 1}/{rounds}: {mode} ...", file=sys.stderr, flush=True)
                    try:
                        jobs.append({**run_job(mode, work, nats.url, args.timeout),
                                     "round": i})
                    except (RuntimeError, subprocess.TimeoutExpired) as exc:
                        # Reported and left out: one job lost to a busy machine.
                        failed.append(f"round {i + 1} {mode}: {str(exc)[:300]}")
                        print(f"  failed: {failed[-1]}", file=sys.stderr, flush=True)
        finally:
            nats.stop()
    # Only rounds in which every trainer ran count, so the differences stay paired.
    done = {(j["round"], j["mode"]) for j in jobs}
    jobs = [j for j in jobs if all((j["round"], m) in done for m in MODES)]
    if not jobs:
        print("no complete round: " + "; ".join(failed), file=sys.stderr)
        return 1
    jobs.sort(key=lambda j: (MODES.index(j["mode"]), j["round"]))
    summary = summarize(jobs)
    print(table(summary))
    tg = summary["trainguard"]
    complete = len(jobs) // len(MODES)
    print(f"\n{RANKS} ranks per job (torchrun, gloo, loopback), {complete} complete rounds "
          f"of {rounds}, interleaved; "
          f"trainguard's extra cost {tg['extra_s']:+.2f} s = {100 * tg['extra_ratio']:+.0f}% "
          f"of plain torch's start (target <= {TARGET_EXTRA_S} s or <= "
          f"{100 * TARGET_EXTRA_RATIO:.0f}%: {'met' if tg['meets_target'] else 'NOT met'}); "
          f"timed inside the ranks: {tg['direct_extra_s']:.2f} s "
          f"({'met' if tg['direct_meets_target'] else 'NOT met'}); "
          f"{(time.time() - started) / 60:.1f} min, load average "
          f"{os.getloadavg()[0]:.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"ranks": RANKS, "rounds": rounds,
                                              "complete_rounds": complete, "failed": failed,
                                              "summary": summary, "jobs": jobs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
