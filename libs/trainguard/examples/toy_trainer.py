"""A small instrumented data-parallel trainer: the five lines of the README, for real.

Runs under torchrun (gloo on CPU) in the end-to-end tests, the demo and the benchmarks.
Each step is mostly a fixed sleep (``--step-time``) plus a tiny model's forward/backward,
so two busy cores do not turn a clean run into stragglers. Gradients are averaged with
an explicit all-reduce in a ``comm`` phase, or by DDP with ``--ddp`` (timed by
``trainguard.torch.instrument_ddp``).

    python -m torch.distributed.run --nproc-per-node 2 -m trainguard.examples.toy_trainer \
        --job demo --steps 200
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import trainguard
import trainguard.torch as tgt


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", default=os.environ.get("TRAINGUARD_JOB", "toy"))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--step-time", type=float, default=0.02,
                   help="seconds of simulated compute per step (default 0.02)")
    p.add_argument("--ddp", action="store_true", help="average gradients with DDP")
    p.add_argument("--heartbeat", type=float, default=0.25)
    p.add_argument("--fingerprint-every", type=int, default=10)
    p.add_argument("--sync-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--raise-at", metavar="RANK:STEP", default=None,
                   help="raise an exception on RANK at STEP (first attempt only): a crash "
                        "without trainguard's drills, for baselines")
    p.add_argument("--raise-message", default="RuntimeError raised by --raise-at")
    p.add_argument("--pg-timeout", type=float, default=120.0,
                   help="process-group timeout in seconds (default 120)")
    return p.parse_args(argv)


class TinyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mlp(self.embed(tokens)).mean(dim=1)
        return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model: nn.Module = TinyModel()
    guard = trainguard.Guard(job=args.job, heartbeat_interval=args.heartbeat,
                             fingerprint_every=args.fingerprint_every,
                             sync_every=args.sync_every, seed=args.seed)
    if args.ddp:
        model = nn.parallel.DistributedDataParallel(model)
        tgt.instrument_ddp(model, guard)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    guard.attach(model, optimizer)
    data = torch.Generator().manual_seed(1000 + rank)
    fail_rank, fail_step = (int(x) for x in args.raise_at.split(":")) if args.raise_at \
        else (-1, -1)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    for step in range(args.steps):
        if rank == fail_rank and step == fail_step and first_attempt:
            raise RuntimeError(args.raise_message)
        with guard.step(step) as s:
            with s.phase("data"):
                tokens = torch.randint(0, 64, (8, 16), generator=data)
                target = torch.randint(0, 64, (8,), generator=data)
            with s.phase("compute"):
                time.sleep(args.step_time)
                loss = nn.functional.cross_entropy(model(tokens), target)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()  # type: ignore[no-untyped-call]
            if not args.ddp:
                with s.phase("comm"):
                    for p in model.parameters():
                        if p.grad is not None:
                            dist.all_reduce(p.grad)
                            p.grad /= world
            s.report(loss=loss.detach(), grad_norm=tgt.grad_norm(model), samples=8)
            optimizer.step()
    guard.close()
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: finished {args.steps} steps", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
