"""The layouts real DTensor models report (FSDP2, HSDP, tensor parallel) on a 4-rank gloo
group, and their fingerprints: equal within a replica group, different across shards."""

from __future__ import annotations

import os
from typing import Any

from tests.ranks import run_ranks


def _layouts(rank: int, world: int, port: int, out: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from trainguard.torch.stats import fingerprint, state_layout

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        found: dict[str, Any] = {}
        torch.manual_seed(0)
        plain = torch.nn.Linear(8, 8)
        found["ddp"] = state_layout(plain)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        found["fsdp"] = state_layout(model)
        hybrid = torch.nn.Sequential(torch.nn.Linear(8, 8))
        mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        fully_shard(hybrid, mesh=mesh2)
        found["hsdp"] = state_layout(hybrid)
        found["hsdp_fp"] = int(fingerprint(hybrid))
        tp_model = torch.nn.Sequential(torch.nn.Linear(8, 8))
        tp_mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(tp_model, tp_mesh["tp"], {"0": ColwiseParallel()})
        found["tp"] = state_layout(tp_model)
        out.put((rank, {k: (v.topology.kind, v.group, v.group_size) if k != "hsdp_fp" else v
                        for k, v in found.items()}))
    finally:
        dist.destroy_process_group()


def test_real_dtensor_models_report_their_replica_groups() -> None:
    got = run_ranks(_layouts, 4, timeout=120)
    for rank, found in got.items():
        assert found["ddp"] == ("replicated", "dp", 4)
        assert found["fsdp"] == ("sharded", f"shard={rank}", 1)
        assert found["hsdp"] == ("hybrid", f"shard={rank % 2}", 2)
        assert found["tp"] == ("hybrid", f"tp={rank % 2}", 2)
    # HSDP replicas of one shard hold bit-equal parameters; the two shards differ.
    assert got[0]["hsdp_fp"] == got[2]["hsdp_fp"] and got[1]["hsdp_fp"] == got[3]["hsdp_fp"]
    assert got[0]["hsdp_fp"] != got[1]["hsdp_fp"]
