"""Host isolation: the decision -> the job's first step at the smaller world size, in place
beside the cold path, in one run.

The demo's two agents (node-a: ranks 0-1 and the job store, node-b: ranks 2-3) run the toy
trainer; once a checkpoint is committed, node-b is isolated (the ``isolate`` command, as
the remediator sends it). In place (``--in-place``): node-b's agent records the smaller
group before its ranks stop and node-a's ranks re-form at world size 2 in their own
processes. Cold (the same trainer without it): node-a's ranks fail and their agent
restarts them at world size 2 from the committed checkpoint. The clock runs from the
command to rank 0's first completed step at world size 2 (its progress file); steps lost
are the completed steps it runs again.

Then node-b comes back (its agent started again; the isolate command went to the agent, so
there is no blocklist entry to end) once torch's rendezvous dropped the agent that left
(:data:`COME_BACK_AFTER_S`): in place, node-a's ranks take it in at their next
command agreement and keep their processes; cold, torch's rendezvous restarts every rank
at world size 4 from the committed checkpoint. That clock runs from the agent's start to
rank 0's first step at world size 4 (the agent's own start, imports included, is part of
both).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_recovery import CKPT_EVERY, HOSTS, STEP_TIME, Tracker

VARIANTS = {"in-place": "trainguard, in place", "restart": "trainguard, group restart"}
WINDOW_S = 90.0
COME_BACK_AFTER_S = 12.0
"""A host comes back after its blocklist TTL (minutes); here once torch's rendezvous dropped
the agent that left (10 missed keep-alives of 1 s, ``launcher.RDZV_DEFAULTS``): until then
it still counts as the round's participant, and a node that comes sooner waits for that."""


def progress(path: Path) -> list[tuple[float, int, int, int]]:
    """Rank 0's completed steps: (time, step, pid, world size)."""
    out = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        parts = line.split()
        extra = dict(p.split("=", 1) for p in parts[4:] if "=" in p)
        if len(parts) < 4 or "fault" in extra or "world" not in extra:
            continue
        out.append((float(parts[0]), int(parts[1]), int(parts[3]), int(extra["world"])))
    return out


async def first_step_at(path: Path, after: float, world: int
                        ) -> tuple[float, int, int, int] | None:
    """Rank 0's first step completed after ``after`` at world size ``world``, within
    :data:`WINDOW_S` (None if none)."""
    deadline = time.monotonic() + WINDOW_S
    while time.monotonic() < deadline:
        back = next((r for r in progress(path) if r[0] > after and r[3] == world), None)
        if back is not None:
            return back
        await asyncio.sleep(0.05)
    return None


async def run(variant: str, root: Path, tracker: Tracker) -> dict[str, Any]:
    from trainguard.contract.codec import encode_durable
    from trainguard.contract.envelope import make_headers
    from trainguard.contract.subjects import Subjects
    from trainguard.contract.targets import addressed
    from trainguard.demo.cluster import Cluster

    class ShrinkCluster(Cluster):
        progress_file: Path

        def launch_argv(self, host: str) -> list[str]:
            return [*super().launch_argv(host), "--progress-file", str(self.progress_file),
                    *(["--in-place"] if variant == "in-place" else [])]

    work = root / variant
    shutil.rmtree(work, ignore_errors=True)
    cluster = ShrinkCluster(work, "bench", steps=1_000_000, step_time=STEP_TIME,
                            ckpt_every=CKPT_EVERY)
    cluster.progress_file = work / "progress"
    res: dict[str, Any] = {"variant": variant, "label": VARIANTS[variant]}
    try:
        await cluster.start(timeout=150)
        for proc in cluster.procs.values():
            tracker.add_root(proc.pid)
        obs = cluster.observer
        deadline = time.monotonic() + 150
        while not (any(k.status == "committed" for k in obs.checkpoints)
                   and obs.max_step >= 30):
            if time.monotonic() > deadline:
                res["pending"] = "no committed checkpoint in 150 s"
                return res
            await asyncio.sleep(0.1)
        before = progress(cluster.progress_file)
        subject, cmd = addressed(Subjects(cluster.prefix), cluster.job, "isolate", {},
                                 issuer="cli", host="node-b")
        t0 = time.time()
        await cluster.publish(subject, encode_durable(cmd),
                              make_headers(cmd, source="bench/bench_shrink", subject=subject))
        back = await first_step_at(cluster.progress_file, t0, 2)
        if back is None:
            res["pending"] = f"no step at world size 2 within {WINDOW_S:.0f} s"
            return res
        done_before = max(r[1] for r in progress(cluster.progress_file)
                          if r[0] <= t0 or r[3] == 4)
        res.update(back_s=round(back[0] - t0, 2), resumed_step=back[1],
                   steps_lost=max(0, done_before - back[1] + 1),
                   rank0_kept=back[2] == before[-1][2] if before else None)
        res["grow"] = await grow(cluster, back[2])
        return res
    except Exception as exc:
        res["pending"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        return res
    finally:
        tracker.kill({p.pid for n, p in cluster.procs.items() if n in HOSTS})
        with contextlib.suppress(Exception):
            await asyncio.wait_for(cluster.stop(), timeout=120)
        tracker.kill({p.pid for p in cluster.procs.values()})


async def grow(cluster: Any, pid: int) -> dict[str, Any]:
    """node-b's agent starts again: its start -> rank 0's first step at world size 4."""
    shrunk = progress(cluster.progress_file)
    deadline = time.monotonic() + 30
    while cluster.procs["node-b"].poll() is None:  # the isolated agent ends first
        if time.monotonic() > deadline:
            return {"pending": "node-b's isolated agent did not end in 30 s"}
        await asyncio.sleep(0.1)
    await asyncio.sleep(COME_BACK_AFTER_S)  # the host is away (no condition to wait on)
    t0 = time.time()
    cluster.start_agent("node-b")
    back = await first_step_at(cluster.progress_file, t0, 4)
    if back is None:
        return {"pending": f"no step at world size 4 within {WINDOW_S:.0f} s"}
    done_before = max((r[1] for r in progress(cluster.progress_file)
                       if r[0] <= back[0] and r[3] == 2),
                      default=shrunk[-1][1] if shrunk else back[1] - 1)
    return {"back_s": round(back[0] - t0, 2), "resumed_step": back[1],
            "steps_lost": max(0, done_before - back[1] + 1), "rank0_kept": back[2] == pid}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| setup | isolate -> first step at world size 2 | steps lost | rank 0 kept "
             "its process |", "| --- | --- | --- | --- |"]
    for r in rows:
        if "pending" in r:
            lines.append(f"| {r['label']} | - ({r['pending']}) | - | - |")
        else:
            lines.append(f"| {r['label']} | {r['back_s']:.2f} s | {r['steps_lost']} | "
                         f"{'yes' if r['rank0_kept'] else 'no'} |")
    lines += ["", "| setup | node-b's agent started -> first step at world size 4 | "
              "steps lost | rank 0 kept its process |", "| --- | --- | --- | --- |"]
    for r in rows:
        g = r.get("grow") or {"pending": r.get("pending", "not run")}
        if "pending" in g:
            lines.append(f"| {r['label']} | - ({g['pending']}) | - | - |")
        else:
            lines.append(f"| {r['label']} | {g['back_s']:.2f} s | {g['steps_lost']} | "
                         f"{'yes' if g['rank0_kept'] else 'no'} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--workdir", default=None, help="keep the clusters' logs here")
    args = p.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    tracker = Tracker()
    rows = []
    with contextlib.ExitStack() as stack:
        tmp = args.workdir or stack.enter_context(tempfile.TemporaryDirectory(
            prefix="bench-shrink-"))
        for variant in variants:
            print(f"running {VARIANTS[variant]} ...", flush=True)
            rows.append(asyncio.run(run(variant, Path(tmp), tracker)))
    print(table(rows))
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows}, indent=2))
    return 0 if all("pending" not in r and "pending" not in r["grow"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
