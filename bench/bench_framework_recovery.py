"""A killed rank under each way of writing a trainer, restart path, one run.

The demo's cluster (``trainguard up`` and two ``trainguard launch`` agents, 2 gloo ranks
each) runs one trainer at a time: the plain loop (``trainguard.examples.toy_trainer``,
without ``--in-place``: the restart path, the same as the callbacks'), the Lightning
callback (``trainguard.examples.lightning_trainer``) and the Hugging Face one
(``trainguard.examples.hf_trainer``), each saving every 10 steps. Once a checkpoint is
committed, training is past it and every host's warm spares are ready (they import what
the trainer imports from installed libraries), rank 1 is killed. Reported per trainer:
the incident's time back (the agent's word of the failure to the first step after the
restart) and its phases, and the steps lost. The loop's figure is the baseline the
callbacks' target is set against ("as fast as the plain loop's path for the same state").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from trainguard.contract.codec import decode_telemetry, encode_durable
from trainguard.contract.envelope import make_headers
from trainguard.contract.schemas import NodeHeartbeat
from trainguard.contract.subjects import Subjects
from trainguard.contract.targets import addressed
from trainguard.demo.cluster import Cluster

TRAINERS = {
    "loop": None,
    "lightning": ["trainguard.examples.lightning_trainer"],
    "hf": ["trainguard.examples.hf_trainer"],
}
EVERY, STEPS = 10, 400


async def until(cond: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return
        await asyncio.sleep(0.2)
    raise TimeoutError(what)


async def one(name: str, work: Path) -> dict[str, object]:
    c = Cluster(work / name, f"bench-{name}", steps=STEPS, step_time=0.1, ckpt_every=EVERY,
                model="tiny", trainer=TRAINERS[name])
    try:
        await c.start(timeout=180)
        obs = c.observer
        spares: dict[str, int] = {}

        async def beat(msg: object) -> None:
            hb = decode_telemetry(msg.data)  # type: ignore[attr-defined]
            if isinstance(hb, NodeHeartbeat):
                spares[hb.host] = len(hb.spares)

        await c.nc.subscribe(Subjects(c.prefix).pattern("node", job=c.job), cb=beat)
        await until(lambda: any(k.status == "committed" for k in obs.checkpoints)
                    and obs.max_step >= 2 * EVERY + 2, 180, "a committed checkpoint")
        await until(lambda: len(spares) == len(c.hosts)
                    and min(spares.values()) >= c.nproc, 180, "every host's spares ready")
        subject, cmd = addressed(Subjects(c.prefix), c.job, "kill", {}, issuer="cli", rank=1,
                                 host="node-a")
        await c.publish(subject, encode_durable(cmd),
                        make_headers(cmd, source="bench", subject=subject))
        await until(lambda: any(i.status == "resolved" for i in obs.incidents.values()), 300,
                    "the incident resolved")
        inc = next(i for i in obs.incidents.values() if i.status == "resolved")
        rec = inc.recovery
        return {"cause": inc.cause, "ranks": inc.ranks, "path": rec.path if rec else None,
                "seconds": rec.seconds if rec else None,
                "phases": rec.phases if rec else {}, "steps_lost": inc.steps_lost}
    finally:
        await c.stop()


async def run(names: list[str]) -> dict[str, dict[str, object]]:
    with tempfile.TemporaryDirectory(prefix="tg-fwrec-") as tmp:
        return {name: await one(name, Path(tmp)) for name in names}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write results as JSON here")
    p.add_argument("--trainers", default=",".join(TRAINERS), help="comma-separated")
    args = p.parse_args()
    results = asyncio.run(run(args.trainers.split(",")))
    print(f"{'trainer':<10} {'cause':<14} {'path':<8} {'back (s)':>8} {'lost':>5}  phases")
    for name, r in results.items():
        phases = " ".join(f"{k} {v:.1f}" for k, v in r["phases"].items())  # type: ignore[union-attr]
        print(f"{name:<10} {r['cause']!s:<14} {r['path']!s:<8} {r['seconds'] or 0:>8.2f} "
              f"{r['steps_lost']!s:>5}  {phases}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
