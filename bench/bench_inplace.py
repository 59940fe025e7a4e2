"""In-place recovery: a survivor's failure seen -> ready to run (re-form + state sync),
beside a cold restart's process start + checkpoint load, for a small and a ~50 MB model on
4 gloo ranks, in one run.

In place: 4 ranks (``trainguard.torch.init_process_group`` + ``guard.steps``, SGD with
momentum, so the optimizer state is as large as the model) train; rank 2 is killed with
SIGKILL; this script plays the agent (bumps the generation in the job store, a
``TCPStore`` of its own) and hands rank 2's place to a warm spare (a process that already
imported torch and waits for its go). Each survivor records its recovery (``rejoin``:
teardown, generation wait, forming; ``sync``: agreement and state; ``total``: failure seen
to ready). Cold: 4 fresh processes start and load the checkpoint of the same model with
``trainguard.torch.Checkpointer`` (DCP); the clock runs from their start to ready (the
slowest rank).

``--fsdp-buddy``: the same, for the model sharded with FSDP2 over the 4 ranks (built by
``trainguard.torch.fsdp``, no replica), ranks 0-1 and 2-3 on two hosts, memory snapshots
every ``--every`` steps copied to a buddy on the other host (``Checkpointer(buddy=True)``):
in place, every rank goes back in memory to the newest step whose every shard is held and
the replacement takes its shard from its buddy; cold, the FSDP2 model loads the checkpoint.
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
from datetime import timedelta
from pathlib import Path
from typing import Any

WORLD = 4
PG_TIMEOUT = 10.0
RUN_ID = "bench-inplace"
MODE: list[str] = []
"""The workers' mode flags (``--fsdp-buddy --every K``)."""
SIZES = {"small": (1, 64), "50MB": (12, 1024)}
"""Model: ``layers`` x Linear(width, width). 12 x 1024^2 floats ~ 50 MB."""


def model_for(size: str) -> Any:
    from torch import nn

    layers, width = SIZES[size]
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def worker(args: argparse.Namespace) -> int:
    if args.go:  # a warm spare: torch is imported, the rest waits for the agent's go
        import torch

        while not Path(args.go).exists():
            time.sleep(0.005)
        os.environ.update(json.loads(Path(args.go).read_text()))
    import torch
    import torch.distributed as dist

    import trainguard
    import trainguard.torch as tgt

    # Two ranks a host: a buddy is on the other one.
    guard = trainguard.Guard(job="bench-inplace", enabled=False,
                             host=f"host{int(os.environ['RANK']) // 2}")
    rec = tgt.init_process_group(guard, "gloo", timeout=args.pg_timeout, rejoin_timeout=120)
    torch.manual_seed(0)
    if args.fsdp_buddy:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        def build(mesh: Any) -> Any:
            torch.manual_seed(0)
            built = model_for(args.size)
            for layer in built:
                fully_shard(layer, mesh=mesh)
            return fully_shard(built, mesh=mesh)

        model = tgt.fsdp(build, guard, mesh=lambda: init_device_mesh(
            "cpu", (dist.get_world_size(),)))
    else:
        model = model_for(args.size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    guard.attach(model, optimizer)
    buddy = args.fsdp_buddy and not args.cold
    ckpt = tgt.Checkpointer(guard, args.root, memory=args.every if buddy else None, buddy=buddy)
    width = SIZES[args.size][1]
    if args.cold:
        ckpt.load(ckpt.path_for(args.ckpt_step), model, optimizer)
        ready = time.time() - float(os.environ["BENCH_SPAWNED_AT"])
        Path(args.out).write_text(json.dumps({"ready": ready}))
        ckpt.close()
        dist.destroy_process_group()
        return 0
    rank = dist.get_rank()

    def train_step(step: int) -> None:
        """In a function of its own: a failed step's graph (and FSDP2's old mesh with it)
        goes with its frame, so an in-place rebuild can close the old groups."""
        x = torch.randn(8, width, generator=torch.Generator().manual_seed(step))
        loss = model(x).square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        if not args.fsdp_buddy:  # FSDP2 reduce-scatters in backward
            for p in model.parameters():
                dist.all_reduce(p.grad)
        optimizer.step()
        time.sleep(0.02)

    lost, last = 0, -1
    for step in guard.steps(0, args.steps):
        if step <= last:
            lost = max(lost, last - step + 1)  # gone back: steps run again
        last = step
        with guard.step(step):
            train_step(step)
        if guard.abandoned == step:
            continue
        if step == args.ckpt_step:
            ckpt.save(step, model, optimizer, blocking=True)
        if rank == 0:
            with open(args.progress, "a") as f:
                f.write(f"{step}\n")
    Path(args.out).write_text(json.dumps([{**r, "lost": lost} for r in rec.recoveries]))
    ckpt.close()
    dist.destroy_process_group()
    return 0


class Harness:
    """The agent's part: the job store, the ranks' environment, kills and replacements."""

    def __init__(self, tmp: Path, size: str) -> None:
        from torch.distributed import PrefixStore, TCPStore

        from trainguard.recovery import groupstore
        from trainguard.runtime.embedded import free_port

        self.tmp, self.size, self.port = tmp, size, free_port()
        self.store = TCPStore("127.0.0.1", self.port, is_master=True,
                              timeout=timedelta(seconds=120), wait_for_workers=False)
        self.job = PrefixStore(groupstore.job_prefix(RUN_ID), self.store)
        self.generation = int(self.job.add(groupstore.GENERATION, 1))
        self.progress = tmp / "progress"

    def env(self, rank: int) -> dict[str, str]:
        return {"RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.port),
                "TORCHELASTIC_RUN_ID": RUN_ID, "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TRAINGUARD_GENERATION": str(self.generation), "GLOO_SOCKET_IFNAME": "lo",
                "OMP_NUM_THREADS": "1"}

    def spawn(self, rank: int, *extra: str, env: dict[str, str] | None = None
              ) -> subprocess.Popen[bytes]:
        argv = [sys.executable, __file__, "--worker", "--size", self.size, *MODE,
                "--pg-timeout", str(PG_TIMEOUT), "--root",
                str(self.tmp / "ckpt"), "--progress", str(self.progress),
                "--out", str(self.tmp / f"rank{rank}.json"), *extra]
        log = open(self.tmp / f"rank{rank}.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(argv, env={**os.environ, **(env or self.env(rank))},
                                stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return proc

    def ready(self) -> bool:
        from trainguard.recovery import groupstore

        return self.job.check([groupstore.in_place_key(self.generation, r)
                               for r in range(WORLD)])


def wait_for(cond: Any, what: str, procs: list[subprocess.Popen[bytes]],
             timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            raise SystemExit(f"bench_inplace: gave up waiting for {what}")
        time.sleep(0.01)


def in_place(tmp: Path, size: str, steps: int) -> dict[str, float]:
    from trainguard.recovery import groupstore

    h = Harness(tmp, size)
    procs = {r: h.spawn(r, "--steps", str(steps), "--ckpt-step", "3") for r in range(WORLD)}
    go = tmp / "go.json"
    spare = h.spawn(2, "--steps", str(steps), "--ckpt-step", "3", "--go", str(go),
                    env=dict(os.environ))
    wait_for(lambda: h.progress.exists() and len(h.progress.read_text().split()) >= 8,
             "step 8", list(procs.values()))
    wait_for(h.ready, "the in-place keys", list(procs.values()))
    procs[2].send_signal(signal.SIGKILL)
    procs[2].wait()
    h.generation = int(h.job.add(groupstore.GENERATION, 1))
    go.write_text(json.dumps({**h.env(2), "TRAINGUARD_JOIN": "peers"}))
    procs[2] = spare
    for p in procs.values():
        if p.wait(300) != 0:
            raise SystemExit(f"bench_inplace: a rank failed; see {tmp}")
    survivors = [json.loads((tmp / f"rank{r}.json").read_text())[0] for r in (0, 1, 3)]
    # Every survivor is ready at about the same moment (the group forms once all are in);
    # the slowest to *see* the failure has the smallest total, the first to see it the
    # largest: that one is the job's time from failure to back at work.
    return {k: max(s[k] for s in survivors) for k in ("rejoin", "sync", "total", "lost")} | \
        {"first_seen_lag": max(s["total"] for s in survivors)
         - min(s["total"] for s in survivors)}


def cold(tmp: Path, size: str) -> float:
    h = Harness(tmp, size)
    t0 = time.time()
    procs = [h.spawn(r, "--cold", "--ckpt-step", "3",
                     env={**h.env(r), "BENCH_SPAWNED_AT": repr(t0)}) for r in range(WORLD)]
    for p in procs:
        if p.wait(300) != 0:
            raise SystemExit(f"bench_inplace: a cold rank failed; see {tmp}")
    return max(json.loads((tmp / f"rank{r}.json").read_text())["ready"] for r in range(WORLD))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--pg-timeout", type=float, default=10.0,
                   help="the ranks' collective timeout: what a survivor that is not a direct "
                        "peer of the lost rank waits before it sees the failure (gloo)")
    p.add_argument("--fsdp-buddy", action="store_true",
                   help="FSDP2 over the 4 ranks, recovered in place from buddy copies")
    p.add_argument("--every", type=int, default=5,
                   help="with --fsdp-buddy: steps between memory snapshots (K)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cold", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--go", help=argparse.SUPPRESS)
    p.add_argument("--size", default="small", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--progress", help=argparse.SUPPRESS)
    p.add_argument("--ckpt-step", type=int, default=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    global PG_TIMEOUT
    PG_TIMEOUT = args.pg_timeout
    if args.fsdp_buddy:
        MODE.extend(["--fsdp-buddy", "--every", str(args.every)])
    results: dict[str, Any] = {}
    print("| model | in place: failure seen -> ready (rejoin + sync) | of which the last "
          "survivor's detection lag | steps lost | cold: start + checkpoint load | ratio |\n"
          "| --- | --- | --- | --- | --- | --- |")
    for size in SIZES:
        rows = []
        for _ in range(args.trials):
            with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
                # The cold run loads the checkpoint the in-place run saved.
                warm = in_place(Path(a), size, args.steps)
                os.rename(Path(a) / "ckpt", Path(b) / "ckpt")
                rows.append((warm, cold(Path(b), size)))
        total = statistics.median(w["total"] for w, _ in rows)
        rejoin = statistics.median(w["rejoin"] for w, _ in rows)
        sync = statistics.median(w["sync"] for w, _ in rows)
        restart = statistics.median(c for _, c in rows)
        lag = statistics.median(w["first_seen_lag"] for w, _ in rows)
        lost = max(w["lost"] for w, _ in rows)
        results[size] = {"in_place_total_s": total, "in_place_rejoin_s": rejoin,
                         "steps_lost": lost, "fsdp_buddy": args.fsdp_buddy,
                         "in_place_sync_s": sync, "detection_lag_s": lag,
                         "cold_start_and_load_s": restart, "pg_timeout_s": PG_TIMEOUT,
                         "ratio": total / restart, "trials": args.trials}
        print(f"| {size} | {total:.2f} s ({rejoin:.2f} + {sync:.2f}) | {lag:.2f} s | {lost} | "
              f"{restart:.2f} s | {total / restart:.2f}x |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
