"""Buddy copies from the Checkpointer on a real 4-rank gloo job of an FSDP2 model, two ranks
per host: every rank's memory snapshots reach a rank on the other host, which keeps the
last two, checked, bit for bit the owner's shard; the snapshot report says so."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from tests.ranks import run_ranks

STEPS = 5


def _run(nats_url: str, root: str, rank: int, world: int, port: int, out: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainguard import Guard
    from trainguard.contract import envnames
    from trainguard.contract.schemas import SnapshotReport
    from trainguard.torch import Checkpointer

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ[envnames.SNAPSHOT_BUDDY_ADDR] = "127.0.0.1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 5))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # A dead NATS URL: what the rank publishes stays in its buffers, to be read here.
    guard = Guard(job="buddy", rank=rank, world_size=world, host=f"h{rank // 2}",
                  nats_url=nats_url, heartbeat_interval=60)
    guard.attach(model, opt)
    ckpt = Checkpointer(guard, root, memory=1, memory_keep=3, use_async=False, buddy=True)
    assert ckpt.buddies is not None
    for step in guard.steps(0, STEPS):
        with guard.step(step):
            g = torch.Generator().manual_seed(step * 10 + rank)
            loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    buddies = ckpt.buddies
    assert buddies.wait_sent(STEPS - 1, 30), (buddies.sent, buddies.failures)
    [held_for] = buddies.held_for
    copy = buddies.wait_held(held_for, STEPS - 1, 30)
    assert copy is not None
    assert ckpt.memory is not None
    own = ckpt.memory.ring[-1]
    reports = [m for _, m in guard.transport.telemetry if isinstance(m, SnapshotReport)]
    out.put((rank, {
        "target": buddies.target_rank, "held_for": held_for, "held": buddies.held(),
        "check": copy.check(), "nbytes": buddies.nbytes, "own_nbytes": own.nbytes,
        "own_crc": own.verdict()[0], "copy_crc": copy.crc,
        "copy_names": copy.names == own.names,
        "report": reports[-1].buddy if reports else None}))
    dist.barrier()  # every copy arrived before a listener closes
    guard.close(timeout=5.0)
    dist.destroy_process_group()


def test_every_rank_s_snapshots_are_held_on_the_other_host(tmp_path: Path) -> None:
    from trainguard.runtime.embedded import free_port

    dead = f"nats://127.0.0.1:{free_port()}"
    got = run_ranks(functools.partial(_run, dead, str(tmp_path)), 4, timeout=180)
    assert {r: g["target"] for r, g in got.items()} == {0: 2, 1: 3, 2: 0, 3: 1}
    assert {r: g["held_for"] for r, g in got.items()} == {0: 2, 1: 3, 2: 0, 3: 1}
    for rank, g in got.items():
        # The last two, checked; the copy of the newest is the owner's shard, as checked.
        assert g["held"] == {g["held_for"]: [STEPS - 2, STEPS - 1]}, (rank, g)
        assert g["check"] == "" and g["copy_names"]
        assert g["copy_crc"] == got[g["held_for"]]["own_crc"]
        assert g["nbytes"] == 2 * got[g["held_for"]]["own_nbytes"]
        assert g["report"] == g["target"]
