"""Restart: time from the restart decision to the replacement rank's first step, a cold
process against a warm spare, interleaved in one run.

The replacement is the real one: ``trainguard.examples.toy_trainer`` (gloo, world size 1,
trainguard enabled, its bus unreachable as after a control-plane blip), started either as
``trainguard launch`` starts a cold rank (``python -u -m ...``) or by handing the rank's
environment to a ready spare of the agent's own pool (:mod:`trainguard.agent.spares`),
which runs it in-process. The clock starts just before the start (or the hand-over) and
stops at the first step's line in the trainer's ``--progress-file``; a spare's warm-up
happens before and is not counted (that is the point of it), but its idle memory is
reported. Trials alternate cold/warm so machine load hits both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trainguard.agent.spare import SpareOrder
from trainguard.agent.spares import SparePool
from trainguard.runtime.embedded import free_port

TRAINER = "trainguard.examples.toy_trainer"


def rank_env() -> dict[str, str]:
    return {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()), "RANK": "0", "LOCAL_RANK": "0",
            "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "OMP_NUM_THREADS": "1",
            "TRAINGUARD_JOB": "bench-restart", "PYTHONUNBUFFERED": "1",
            "TRAINGUARD_NATS_URL": f"nats://127.0.0.1:{free_port()}"}


def first_step(progress: Path, proc: subprocess.Popen[bytes], timeout: float) -> float:
    """The time of the first completed step (the trainer's own clock)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if progress.exists():
            for line in progress.read_text().splitlines():
                parts = line.split()
                if len(parts) >= 2 and "fault=" not in line:
                    return float(parts[0])
        if proc.poll() is not None:
            raise RuntimeError(f"the trainer exited ({proc.returncode}) before its first step")
        time.sleep(0.005)
    raise TimeoutError(f"no first step within {timeout} s")


def args_for(progress: Path) -> list[str]:
    return ["--steps", "2", "--step-time", "0", "--progress-file", str(progress)]


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def finish(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def cold(work: Path, n: int, timeout: float) -> float:
    progress = work / f"cold-{n}.progress"
    with open(work / f"cold-{n}.log", "wb") as log:
        t0 = time.time()
        proc = subprocess.Popen([sys.executable, "-u", "-m", TRAINER, *args_for(progress)],
                                env=rank_env(), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=log, start_new_session=True)
    try:
        return first_step(progress, proc, timeout) - t0
    finally:
        finish(proc)


def warm(work: Path, n: int, timeout: float, rss: list[int]) -> float:
    pool = SparePool(1, rank_env(), str(work))
    try:
        pool.fill()
        deadline = time.monotonic() + timeout
        spare = pool.take()
        while spare is None and time.monotonic() < deadline:
            time.sleep(0.01)
            spare = pool.take()
        if spare is None:
            raise TimeoutError(f"no warm spare ready within {timeout} s")
        rss.append(rss_kib(spare.pid))
        progress = work / f"warm-{n}.progress"
        env = rank_env()
        t0 = time.time()
        proc = spare.activate(SpareOrder(
            env=env, argv=[TRAINER, *args_for(progress)], cwd=os.getcwd(),
            stdout=str(work / f"warm-{n}.log"), stderr=str(work / f"warm-{n}.log"),
            module=TRAINER))
        try:
            return first_step(progress, proc, timeout) - t0
        finally:
            finish(proc)
    finally:
        pool.close()


def summary(xs: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()
    times: dict[str, list[float]] = {"cold": [], "warm": []}
    rss: list[int] = []
    with tempfile.TemporaryDirectory(prefix="bench-restart-") as tmp:
        work = Path(tmp)
        for n in range(args.trials):
            times["cold"].append(cold(work, n, args.timeout))
            times["warm"].append(warm(work, n, args.timeout, rss))
    result = {k: summary(v) for k, v in times.items()}
    result["speedup"] = {"cold_over_warm": result["cold"]["median_s"]
                         / result["warm"]["median_s"]}
    result["spare_idle_rss_mib"] = {"median": statistics.median(rss) / 1024}
    result["trials"] = {"n": args.trials}
    print("| replacement rank | decision -> first step (median) | min | max |")
    print("| --- | --- | --- | --- |")
    for k in ("cold", "warm"):
        r = result[k]
        label = "cold process" if k == "cold" else "warm spare"
        print(f"| {label} | {r['median_s']:.2f} s | {r['min_s']:.2f} s | {r['max_s']:.2f} s |")
    print(f"\nwarm spare: {result['speedup']['cold_over_warm']:.1f}x faster; an idle spare "
          f"holds {result['spare_idle_rss_mib']['median']:.0f} MiB RSS; "
          f"{args.trials} trials each, interleaved")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
