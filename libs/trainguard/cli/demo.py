"""``trainguard demo``: the whole system recovering real training, live.

Starts the embedded control plane and two agents (node-a, node-b; 2 CPU ranks each) that
train a small transformer language model with checkpoints, plays a fault schedule, shows
per-rank progress and the incident timeline as it happens, and ends with a summary per
fault. Exits 1 if any fault was missed, misdiagnosed or not recovered from.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from trainguard.contract.envnames import setting
from trainguard.contract.errors import ConfigError
from trainguard.demo.scenario import FAULTS, parse_faults

from . import extras


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="watch trainguard recover a real training job",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", default="all",
                   help=f"'all', 'none' or a comma list of: {', '.join(FAULTS)} "
                        "(append @rank=N to pick the rank)")
    p.add_argument("--no-faults", action="store_true", help="a clean run (same as --faults none)")
    p.add_argument("--steps", type=int, default=100_000, help="job length in steps")
    p.add_argument("--step-time", type=float, default=0.05, help="seconds per step (sleep)")
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--clean-seconds", type=float, default=20.0,
                   help="how long the clean run trains (--no-faults)")
    p.add_argument("--workdir", help="keep logs and checkpoints here (default: a temp dir)")
    p.add_argument("--plain", action="store_true", help="no live view (logs, CI)")
    p.add_argument("--cold", action="store_true",
                   help="recover by restarting the whole group from its checkpoint, as "
                        "torchrun does (default: in place, the survivors keep their "
                        "processes), to compare the two")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    extras.require("services", "trainguard demo")
    try:
        faults = [] if args.no_faults else parse_faults(args.faults)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if args.workdir:
        return asyncio.run(_demo(args, faults, Path(args.workdir)))
    with tempfile.TemporaryDirectory(prefix="trainguard-demo-") as tmp:
        return asyncio.run(_demo(args, faults, Path(tmp)))


async def _demo(args: argparse.Namespace, faults: list, workdir: Path) -> int:  # type: ignore[type-arg]
    from rich.console import Console
    from rich.live import Live

    from trainguard.demo.cluster import Cluster
    from trainguard.demo.runner import Runner
    from trainguard.demo.view import live, summary

    console = Console(width=None if sys.stdout.isatty() else 160)
    # The demo plays a fault every few seconds where a real job meets one every few hours:
    # the coordinator's checkpoint interval (Young/Daly, at least a minute by default) is
    # compressed alike, or a restart would go back to the demo's first checkpoint.
    compressed = {setting("interval_min"): "10", setting("mtbf_prior"): "600"}
    cluster = Cluster(workdir, "demo", steps=args.steps, step_time=args.step_time,
                      ckpt_every=args.ckpt_every, in_place=not args.cold,
                      plane_env=compressed)
    console.print(f"starting the control plane and two agents (logs in {workdir}) ...")
    try:
        await cluster.start()
        runner = Runner(cluster)
        refresh = asyncio.Event()

        async def show() -> None:
            if args.plain:
                shown = 0
                while not refresh.is_set():
                    for t, text in cluster.observer.timeline[shown:]:
                        # An error's text ("[/__w/.../pair.cc:553]") is not markup.
                        console.print(time.strftime("%H:%M:%S ", time.localtime(t)) + text,
                                      highlight=False, markup=False)
                    shown = len(cluster.observer.timeline)
                    await asyncio.sleep(0.5)
                return
            with Live(live(cluster.observer, "job demo"), console=console,
                      refresh_per_second=4) as view:
                while not refresh.is_set():
                    view.update(live(cluster.observer, "job demo"))
                    await asyncio.sleep(0.25)

        viewer = asyncio.create_task(show())
        try:
            if not faults:
                await asyncio.sleep(args.clean_seconds)
            for fault in faults:
                await runner.play(fault)
        finally:
            refresh.set()
            await viewer
        console.print(summary(runner.outcomes, runner.goodput(),
                              "cold group restarts" if args.cold else "in place"))
        if not faults:
            n = len([a for a in cluster.observer.anomalies if a.status == "open"])
            console.print(f"clean run: {n} anomalies, max step {cluster.observer.max_step}")
            return 1 if n else 0
        return 0 if all(o.ok for o in runner.outcomes) else 1
    finally:
        await cluster.stop()
