"""A data-parallel CPU trainer that checkpoints with ``trainguard.torch.Checkpointer``.

Each rank draws its batch and its dropout masks from the global torch RNG, seeded per
rank, so a resumed run matches an uninterrupted one only if the checkpoint restores model,
optimizer *and* each rank's RNG state. It records what the end-to-end tests compare:

* ``losses-rank<r>.txt``: ``<step> <loss as float.hex>`` per step, flushed as it goes (a
  killed run keeps what it wrote);
* ``state-rank<r>-step<S>.pt``: model and optimizer state at each periodic checkpoint;
* ``loaded-rank<r>.pt``: the state right after ``load`` on resume, with the step;
* ``pid-rank<r>``: the worker's pid, so a test can kill exactly its processes (torchrun
  starts workers in sessions of their own; they also die with their launcher here).

    python -m torch.distributed.run --nproc-per-node 2 -m tests.e2e.ckpt_trainer \
        --job j --root /tmp/ckpt --out /tmp/out --steps 30 --every 5
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import trainguard
from trainguard.torch import Checkpointer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=0, help="checkpoint every N steps (0: never)")
    p.add_argument("--step-time", type=float, default=0.02)
    p.add_argument("--sync-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="resume from the coordinator's point")
    p.add_argument("--side-timeout", type=float, default=30.0)
    p.add_argument("--ignore-save-now-rank", type=int, default=-1,
                   help="this rank acknowledges save_now without saving")
    return p.parse_args(argv)


def die_with_parent() -> None:
    """Linux: SIGKILL this worker when its launcher dies, as a killed job's workers should."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.1), nn.GELU(), nn.Linear(64, 4))


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"step": step,
            "model": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": optimizer.state_dict()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    die_with_parent()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"pid-rank{rank}").write_text(str(os.getpid()))
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = trainguard.Guard(job=args.job, heartbeat_interval=0.25, fingerprint_every=0,
                             sync_every=args.sync_every, checkpoint_every=args.every or None)
    guard.attach(model, optimizer)
    ckpt = Checkpointer(guard, args.root, timeout=args.side_timeout)
    if rank == args.ignore_save_now_rank:
        guard.on("save_now", lambda cmd: "ignored on purpose")
    torch.manual_seed(args.seed + 1000 + rank)  # each rank's own data and dropout stream
    start = 0
    if args.resume:
        start = ckpt.resume(model, optimizer)  # the newest committed checkpoint that loads
        if start > 0:
            torch.save(snapshot(model, optimizer, start - 1), out / f"loaded-rank{rank}.pt")
    losses = open(out / f"losses-rank{rank}.txt", "a")  # noqa: SIM115 - kept open all run
    for step in range(start, args.steps):
        with guard.step(step) as s:
            x, y = torch.randn(8, 16), torch.randn(8, 4)
            time.sleep(args.step_time)
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world
            s.report(loss=loss.detach())
            optimizer.step()
        losses.write(f"{step} {loss.item().hex()}\n")
        losses.flush()
        if guard.should_checkpoint(step):
            torch.save(snapshot(model, optimizer, step), out / f"state-rank{rank}-step{step}.pt")
            ckpt.save(step, model, optimizer)
    losses.close()
    ckpt.close()
    guard.close()
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: finished at step {args.steps}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
