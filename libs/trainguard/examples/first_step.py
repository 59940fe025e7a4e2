"""How long a rank takes from its process start to its first completed step.

The smallest data-parallel trainer (a linear model, gradients all-reduced over gloo), run
by torchrun in one of two modes: ``--mode plain`` imports torch only, ``--mode trainguard``
is what an instrumented rank does before it trains: ``import trainguard``, a Guard, a
Checkpointer, ``resume()`` and the step inside ``guard.step`` (with
``TRAINGUARD_DISABLED=1`` that trainer runs with trainguard off). Each rank writes
``<out>/rank-<r>.json`` once its first step is done: when its process started (from
``/proc``), when torch's and trainguard's imports, its process group, its model and
trainguard's set-up (Guard, Checkpointer, resume lookup; after a barrier, so it is this
rank's own time) and its first step were done (epoch seconds). ``bench/bench_start.py``
and an end-to-end test read those files.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any


def process_start_time() -> float:
    """This process's start (epoch seconds, 1/CLK_TCK resolution): the interpreter's own
    start-up counts, as it does for a rank that a launcher starts."""
    with open("/proc/self/stat", "rb") as fh:
        fields = fh.read().decode().rsplit(")", 1)[1].split()
    started_since_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - started_since_boot
    return time.time() - age


def main(argv: list[str] | None = None) -> int:
    started = process_start_time()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("plain", "trainguard"), required=True)
    p.add_argument("--out", required=True, help="directory for rank-<r>.json")
    p.add_argument("--job", default="first-step")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--ckpt-root", default=None, help="the Checkpointer's root (trainguard)")
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    torch_imported = time.time()
    guard: Any = None
    if args.mode == "trainguard":
        import trainguard
        import trainguard.torch as tgt
    imported = time.time()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    pg_ready = time.time()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    dist.barrier()  # the set-up below then times this rank's own work, not a peer's lag
    model_ready = time.time()
    start = 0
    if args.mode == "trainguard":
        guard = trainguard.Guard(job=args.job)
        guard.attach(model, optimizer)
        root = args.ckpt_root or os.path.join(args.out, "ckpt")
        ckpt = tgt.Checkpointer(guard, root=root)
        start = ckpt.resume(model, optimizer)
    set_up = time.time()
    x = torch.randn(32, 64)
    record: dict[str, Any] = {"rank": rank, "mode": args.mode, "pid": os.getpid(),
                              "disabled": bool(guard is not None and not guard.enabled),
                              "process_start": started, "imported": imported,
                              "pg_ready": pg_ready, "torch_imported": torch_imported,
                              "model_ready": model_ready, "set_up": set_up}
    for step in range(start, start + args.steps):
        with guard.step(step) if guard is not None else contextlib.nullcontext():
            optimizer.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            for param in model.parameters():
                assert param.grad is not None
                dist.all_reduce(param.grad)
            optimizer.step()
        if step == start:
            record["first_step"] = time.time()
            dest = Path(args.out) / f"rank-{rank}.json"
            tmp = dest.with_suffix(".tmp")
            tmp.write_text(json.dumps(record))
            tmp.replace(dest)
    if guard is not None:
        guard.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
