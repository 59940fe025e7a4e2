"""An HSDP model re-formed in place, on a real 4-rank gloo group (2 replicas x 2 shards).

Every rank tears its group down, forms a new one and rebuilds the model on the new mesh
(:class:`trainguard.recovery.fsdprebuild.InPlaceFSDP`); rank 2 then starts over as a
replacement would, with a fresh model and a fresh AdamW, and takes its shard and optimizer
state from rank 0, its replica (``share_state`` over the replicate group). Training goes on,
and the parameters match, bit for bit, those of the same run with no re-form.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

from tests.ranks import run_ranks

STEPS = 3


def _train(model: Any, optimizer: Any, rank: int, steps: range) -> None:
    import torch

    for step in steps:
        g = torch.Generator().manual_seed(step * 10 + rank)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 5, generator=g)
        loss = ((model(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _run(rank: int, world: int, port: int, out: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainguard.recovery.fsdprebuild import fsdp
    from trainguard.recovery.loop import CommandState
    from trainguard.recovery.sharding import replica_dim, replica_groups
    from trainguard.recovery.statesync import JOINER, StateAgreement, share_state, source_within

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = TCPStore("127.0.0.1", port, world, rank == 0)

    def form(generation: int) -> None:
        dist.init_process_group("gloo", store=PrefixStore(f"g{generation}/", store), rank=rank,
                                world_size=world)

    def build(mesh: Any, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 5))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    def make_mesh() -> Any:
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))

    def full(model: nn.Module) -> dict[str, Any]:
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))

    form(0)
    guard = SimpleNamespace(recovery=None, optimizer=None)
    reference = fsdp(build, guard, mesh=make_mesh)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    _train(reference, opt, rank, range(2 * STEPS))
    expected = full(reference)
    del reference, opt

    model = fsdp(build, guard, mesh=make_mesh)
    guard.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, guard.optimizer, rank, range(STEPS))
    model.release()
    dist.destroy_process_group()
    form(1)
    if rank == 2:  # a replacement: its own fresh state, nothing it could hand over
        model = fsdp(lambda mesh: build(mesh, seed=7), guard, mesh=make_mesh)
        guard.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        model.rebuild()  # the same collectives (the mesh's groups) as the replacement's build
    where = replica_dim(model.parameters())
    assert where is not None
    mesh, dim = where
    groups = replica_groups(mesh.mesh.tolist(), dim)
    steps = tuple(JOINER if r == 2 else STEPS - 1 for r in range(world))
    agreed = StateAgreement(source=0, completed=STEPS - 1, joined=[2], failed_step=None,
                            failure_time=None, command_state=CommandState(0, 0, 0),
                            steps=steps)
    mine = next(g for g in groups if rank in g)
    if 2 in mine:
        share_state(model, guard.optimizer, source_within(agreed, mine), torch.device("cpu"),
                    group=mesh.get_group(dim))
    _train(model, guard.optimizer, rank, range(STEPS, 2 * STEPS))
    got = full(model)
    out.put((rank, {"groups": groups, "dim": dim, "builds": model.builds,
                    "equal": sorted(k for k in expected if torch.equal(expected[k], got[k])),
                    "keys": sorted(expected)}))
    dist.destroy_process_group()


def test_an_hsdp_model_rebuilt_in_place_trains_on_as_if_nothing_happened() -> None:
    got = run_ranks(_run, 4, timeout=180)
    for rank, found in got.items():
        assert found["dim"] == 0 and found["groups"] == [[0, 2], [1, 3]]
        assert found["builds"] == (1 if rank == 2 else 2)  # the replacement built once
    # The full parameters, gathered to rank 0.
    assert got[0]["keys"] and got[0]["equal"] == got[0]["keys"], got[0]
