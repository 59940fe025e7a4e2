"""A sharded CPU trainer (gloo) that saves and loads with ``trainguard.torch.Checkpointer``.

The model is a tiny MLP, built the same way in every mode and then laid out by ``--mode``:

* ``fsdp``: FSDP2 ``fully_shard`` per layer and at the root, on a 1-D mesh over the world;
* ``hsdp``: the same on a 2-D mesh ``("replicate", "shard")`` of ``--replicate`` rows;
* ``tp``: tensor parallel (``up`` column-wise, ``down`` row-wise) on the ``tp`` dimension of a
  2-D mesh ``("dp", "tp")`` of ``--tp`` columns, with FSDP2 on ``dp``;
* ``ddp``: plain DDP.

The optimizer is AdamW, so its state (``exp_avg``, ``exp_avg_sq``) is sharded like the
parameters. Phases:

* ``save``: train ``--steps`` steps, save step ``steps - 1`` with
  ``Checkpointer(guard, root).save(..., blocking=True)``, then gather the full model and
  optimizer state (``full_state_dict=True, cpu_offload=True``): rank 0 writes it to
  ``<out>/saved.pt`` as the reference; each rank writes its ``CheckpointReport`` to
  ``<out>/report-rank<r>.json``;
* ``load``: build the model from other initial weights, ``Checkpointer.load(--path, ...)``,
  gather the full state the same way (``<out>/loaded.pt``, with the step ``load`` returned),
  then train one more step (the loaded state must be usable at this layout and size).

Each rank seeds its global torch RNG stream of its own after building the model and writes
that stream's state as the checkpoint has it (``<out>/rng-rank<r>.pt``: after the save, or
after the load; ``rng-before-rank<r>.pt``: before the load).

    python -m torch.distributed.run --nproc-per-node 4 -m tests.e2e.shard_trainer \
        --job j --root /tmp/ckpt --out /tmp/out --mode fsdp --phase save --steps 3
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

import trainguard
from trainguard.torch import Checkpointer

MODES = ("fsdp", "hsdp", "tp", "ddp")
D_IN, D_MODEL, D_HIDDEN, D_OUT = 16, 32, 64, 5
"""D_OUT = 5 does not divide by 2, 4 or 8: the ``out`` layer's shards are uneven, and empty
on some ranks of an 8-rank job."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--phase", choices=("save", "load"), required=True)
    p.add_argument("--steps", type=int, default=3, help="save: steps trained before saving")
    p.add_argument("--path", help="load: the checkpoint directory")
    p.add_argument("--replicate", type=int, default=2, help="hsdp: rows of the mesh")
    p.add_argument("--tp", type=int, default=2, help="tp: columns of the mesh")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def die_with_parent() -> None:
    """Linux: SIGKILL this worker when its launcher dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D_MODEL, D_HIDDEN)
        self.down = nn.Linear(D_HIDDEN, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, D_MODEL)
        self.mlp = MLP()
        self.norm = nn.LayerNorm(D_MODEL)
        self.out = nn.Linear(D_MODEL, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.inp(x))
        return self.out(self.norm(h + self.mlp(h)))


def lay_out(model: Net, args: argparse.Namespace, world: int) -> tuple[nn.Module, int]:
    """``model`` in ``args.mode``'s layout, and this rank's data-parallel rank (the ranks of
    a tensor-parallel group must see the same batch)."""
    rank = dist.get_rank()
    if args.mode == "ddp":
        return DistributedDataParallel(model), rank
    mesh: DeviceMesh
    if args.mode == "fsdp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
        dp_rank = rank
    elif args.mode == "hsdp":
        mesh = init_device_mesh("cpu", (args.replicate, world // args.replicate),
                                mesh_dim_names=("replicate", "shard"))
        dp_rank = rank
    else:
        mesh2d = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(model.mlp, mesh2d["tp"],
                           {"up": ColwiseParallel(), "down": RowwiseParallel()})
        mesh = mesh2d["dp"]
        dp_rank = mesh.get_local_rank()
    # Under TP the MLP's output is a DTensor's local view: as a module of its own FSDP2 would
    # warn about it, so its parameters join the root's group there.
    layers = (model.inp, model.out) if args.mode == "tp" else (model.inp, model.mlp, model.out)
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, dp_rank


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The whole model and optimizer state, gathered (collective); complete on rank 0."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {"model": get_model_state_dict(model, options=options),
            "optim": get_optimizer_state_dict(model, optimizer, options=options)}


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, data: torch.Generator,
               ) -> torch.Tensor:
    x = torch.randn(8, D_IN, generator=data)
    y = torch.randn(8, D_OUT, generator=data)
    loss = nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    return loss.detach()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    die_with_parent()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # The same initial weights on every rank; a load starts from other ones, so whatever it
    # failed to restore shows.
    torch.manual_seed(args.seed + (1 if args.phase == "load" else 0))
    model, dp_rank = lay_out(Net(), args, world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = trainguard.Guard(job=args.job, heartbeat_interval=0.25, fingerprint_every=0)
    ckpt = Checkpointer(guard, args.root)
    data = torch.Generator().manual_seed(args.seed + 100 + dp_rank)
    # Each rank's own global RNG stream, which the checkpoint carries per rank.
    torch.manual_seed(args.seed + 1000 + (500 if args.phase == "load" else 0) + rank)
    if args.phase == "save":
        step = args.steps - 1
        for n in range(args.steps):
            with guard.step(n) as s:
                s.report(loss=train_step(model, optimizer, data))
        ckpt.save(step, model, optimizer, blocking=True)
        report = ckpt.wait() or ckpt.reports[-1]
        (out / f"report-rank{rank}.json").write_bytes(msgspec.json.encode(report))
        if not report.ok:
            raise RuntimeError(f"rank {rank}: the save failed: {report.error}")
        state, name = full_state(model, optimizer), "saved.pt"
    else:
        torch.save(torch.get_rng_state(), out / f"rng-before-rank{rank}.pt")
        step = ckpt.load(args.path, model, optimizer)
        state, name = full_state(model, optimizer), "loaded.pt"
    torch.save(torch.get_rng_state(), out / f"rng-rank{rank}.pt")
    if rank == 0:
        torch.save({"step": step, "world": world, "mode": args.mode, **state}, out / name)
    if args.phase == "load":
        with guard.step(step + 1) as s:
            loss = train_step(model, optimizer, data)
            s.report(loss=loss)
        if not torch.isfinite(loss):
            raise RuntimeError(f"rank {rank}: loss {loss.item()} after the load")
    ckpt.close()
    guard.close()
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: {args.phase} done ({args.mode}, world {world}, step {step})",
          file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
