"""Pre-flight time on a healthy node, without DCGM (target: <= 30 s).

What ``trainguard launch`` runs before its ranks start, here on this machine: the NVML
checks read a recorded healthy ``nvidia-smi -q`` report and the InfiniBand check a
recorded healthy sysfs tree (tests/fixtures/health/; this machine has neither), while
the gloo all-reduce bandwidth test over loopback (2 ranks, 32 MB, 5 iterations) and the
checkpoint-root write test (64 MB, fsync) run for real. ``dcgmi`` is absent: that check
is skipped. Reported: each check's seconds and the whole run, median of ``--rounds``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import msgspec

from trainguard.health import preflight
from trainguard.health.nvsmi import gpus
from trainguard.health.settings import PreflightSettings
from trainguard.runtime.config import load_settings

FIX = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "health"
TARGET_S = 30.0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out")
    a = p.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="tg-preflight-bench-") as root:
        settings = load_settings(PreflightSettings, env={}, overrides={
            "sysfs_root": str(FIX / "ib" / "healthy"),
            "kernel_log": str(FIX / "kernel" / "clean.log"),
            "checkpoint_root": root, "preflight_allreduce_procs": 2})
        reading = gpus((FIX / "nvml" / "healthy.txt").read_text())
        for _ in range(a.rounds):
            # The recorded GPU would make the bandwidth test NCCL's: the GPU-reading checks
            # run over it, the measured ones as on a node without GPUs (gloo), one after
            # the other, as one pre-flight runs them.
            read = preflight.run(settings, job="bench", host="bench", gpus=reading,
                                 trigger="cli", only=["nvml", "dcgm", "ib"])
            measured = preflight.run(settings, job="bench", host="bench", gpus=None,
                                     trigger="cli", only=["allreduce", "disk"])
            report = msgspec.structs.replace(read, checks=read.checks + measured.checks,
                                             seconds=read.seconds + measured.seconds)
            if "fail" in (read.status, measured.status):
                print(preflight.render(report), file=sys.stderr)
                return 1
            runs.append(report)
    total = statistics.median(r.seconds for r in runs)
    groups: dict[str, list[float]] = {}
    for r in runs:
        seen: dict[str, float] = {}
        for c in r.checks:
            seen[c.name.split(":")[0].split(".")[0]] = c.seconds
        for k, v in seen.items():
            groups.setdefault(k, []).append(v)
    per = {k: round(statistics.median(v), 3) for k, v in groups.items()}
    last = runs[-1]
    measured = {c.name: c.value for c in last.checks if c.name in ("disk",)
                or c.name.startswith("allreduce")}
    print("| check | seconds (median) |\n| --- | --- |")
    for k, v in per.items():
        print(f"| {k} | {v} |")
    print(f"| **total** | **{round(total, 2)}** (target <= {TARGET_S:g} s) |")
    print(f"measured: {measured}")
    if a.out:
        Path(a.out).write_text(json.dumps({"total_s": round(total, 3), "per_check_s": per,
                                           "measured": measured, "rounds": a.rounds,
                                           "target_s": TARGET_S}))
    return 0 if total <= TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
