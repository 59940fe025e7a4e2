"""Which ranks hold the same state (:mod:`trainguard.recovery.sharding`): the pure rule as a
table (real DTensor models: tests/integration/test_sharding_layouts.py)."""

from __future__ import annotations

import pytest

from trainguard.recovery.sharding import MeshDim, group_of, read_declaration

D = MeshDim


@pytest.mark.parametrize(("dims", "world", "kind", "group", "replicas"), [
    ([], 4, "replicated", "dp", 4),                                        # DDP
    ([D("shard", 4, 2, True)], 4, "sharded", "shard=2", 1),                # FSDP2
    ([D("replicate", 2, 1, False), D("shard", 2, 0, True)], 4, "hybrid", "shard=0", 2),
    ([D("tp", 2, 1, True)], 8, "hybrid", "tp=1", 4),                       # TP x plain DDP
    ([D("dp", 2, 0, True), D("tp", 2, 1, True)], 4, "sharded", "dp=0,tp=1", 1),  # FSDP x TP
])
def test_replica_groups(dims: list[MeshDim], world: int, kind: str, group: str,
                        replicas: int) -> None:
    layout = group_of(dims, world)
    assert (layout.topology.kind, layout.group, layout.group_size) == (kind, group, replicas)
    assert layout.topology.sharded_dims == [d.name for d in dims if d.sharded]


@pytest.mark.parametrize(("raw", "kind", "group", "size"), [
    (b"1", "replicated", "dp", 0),
    (b"hybrid 2 shard=1", "hybrid", "shard=1", 2),
    (b"sharded 1 dp=0,tp=1", "sharded", "dp=0,tp=1", 1),
    (b"something else", "sharded", "unreadable:something else", 1),
])
def test_declarations_read_back(raw: bytes, kind: str, group: str, size: int) -> None:
    d = read_declaration(raw)
    assert (d.kind, d.group, d.group_size) == (kind, group, size)
