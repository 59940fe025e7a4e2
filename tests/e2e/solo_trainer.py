"""A rank that trains alone (no process group): what a single-rank restart needs until
in-place recovery lets gloo survivors re-form. Each step is a fixed sleep.

    trainguard launch --job J --nproc-per-node 2 -m -- tests.e2e.solo_trainer --steps 1000
"""

from __future__ import annotations

import argparse
import time

import trainguard


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--job", default=None)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--step-time", type=float, default=0.05)
    args = p.parse_args()
    guard = trainguard.Guard(job=args.job, heartbeat_interval=0.2)
    for step in range(args.steps):
        with guard.step(step):
            time.sleep(args.step_time)
    guard.close()


if __name__ == "__main__":
    main()
