"""Soak: a healthy job with irregular steps, watched by the whole control plane: no false hang.

The demo's cluster (``trainguard up``, agents ``node-a`` and ``node-b``, 4 ranks of
``trainguard.examples.toy_trainer`` on gloo, a checkpoint every 10 steps, fingerprints) runs
steps of 50 ms made irregular the way real jobs are: each rank's compute jittered
(log-normal, sigma 0.3), a slow first step (``--first-step-seconds``, a compile), an
evaluation on every rank every 400 steps (phase ``eval``), data loaders refilling about
every 150 steps for up to 2 s, one rank at a time while its peers wait (``--refill-alone``).
Nothing is injected. It counts what the control plane raised over ``--minutes`` (default 10;
``--quick``: 2): anomalies by kind, incidents and actions. The detector's own defaults
judge it (a 1 s hang floor where the job shows a wait).

Everything binds to 127.0.0.1 on free ports; the cluster's processes stop at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from trainguard.demo.cluster import Cluster

STEP_TIME = 0.05
IRREGULAR = ["--jitter", "0.3", "--first-step-seconds", "5", "--eval-every", "400",
             "--eval-seconds", "4", "--refill-every", "150", "--refill-seconds", "2",
             "--refill-alone"]


class SoakCluster(Cluster):
    """The demo's cluster with the trainer's irregular steps (its flags close the line)."""

    def launch_argv(self, host: str) -> list[str]:
        return [*super().launch_argv(host), *IRREGULAR]


async def soak(minutes: float, workdir: Path) -> dict[str, Any]:
    cluster = SoakCluster(workdir, "soak", steps=1_000_000, step_time=STEP_TIME, ckpt_every=10)
    try:
        await cluster.start(timeout=300)
        obs = cluster.observer
        first = obs.max_step
        await asyncio.sleep(60 * minutes)  # nothing to wait for: the job just runs
        raised = [a for a in obs.anomalies if a.rev == 1]
        return {
            "minutes": minutes, "steps": obs.max_step - first,
            "checkpoints": sum(1 for c in obs.checkpoints if c.status == "committed"),
            "anomalies": dict(collections.Counter(a.kind for a in raised)),
            "hangs": [{"ranks": a.ranks, "limit": getattr(a.evidence, "limit", None),
                       "basis": getattr(a.evidence, "limit_basis", "")}
                      for a in raised if a.kind == "hang"],
            "incidents": len(obs.incidents), "actions": len(obs.actions),
        }
    finally:
        await cluster.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--quick", action="store_true", help="2 minutes")
    p.add_argument("--out", help="write the result as JSON here")
    p.add_argument("--workdir", help="keep the cluster's logs here (default: a temp dir)")
    args = p.parse_args()
    minutes = 2.0 if args.quick else args.minutes
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
        result = asyncio.run(soak(minutes, Path(args.workdir)))
    else:
        with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp:
            result = asyncio.run(soak(minutes, Path(tmp)))
    print(f"| soak | steps | checkpoints | anomalies | incidents | actions |\n"
          f"| --- | ---: | ---: | --- | ---: | ---: |\n"
          f"| {minutes:g} min, 4 ranks, 50 ms steps, irregular | {result['steps']} "
          f"| {result['checkpoints']} | {result['anomalies'] or 'none'} "
          f"| {result['incidents']} | {result['actions']} |")
    print(f"\ntrainer flags: --step-time {STEP_TIME} {' '.join(IRREGULAR)}")
    for hang in result["hangs"]:
        print(f"false hang: {hang}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 1 if result["hangs"] else 0


if __name__ == "__main__":
    sys.exit(main())
