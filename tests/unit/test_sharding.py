"""Which ranks hold the same state (:mod:`trainguard.recovery.sharding`): the pure rule as a
table (real DTensor models: tests/integration/test_sharding_layouts.py)."""

from __future__ import annotations

import pytest

from trainguard.recovery.sharding import (
    MeshDim,
    declaration,
    group_of,
    holding,
    read_declaration,
    replica_groups,
)

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


@pytest.mark.parametrize(("raw", "kind", "group", "size", "rebuilds"), [
    (b"1", "replicated", "dp", 0, False),
    (b"hybrid 2 shard=1", "hybrid", "shard=1", 2, False),
    (b"hybrid 2 shard=1 rebuilds", "hybrid", "shard=1", 2, True),
    (b"sharded 1 shard=1 rebuilds kept", "sharded", "shard=1", 1, True),
    (b"sharded 1 dp=0,tp=1", "sharded", "dp=0,tp=1", 1, False),
    (b"something else", "sharded", "unreadable:something else", 1, False),
    (b"hybrid 2 shard=1 maybe", "sharded", "unreadable:hybrid 2 shard=1 maybe", 1, False),
])
def test_declarations_read_back(raw: bytes, kind: str, group: str, size: int,
                                rebuilds: bool) -> None:
    d = read_declaration(raw)
    assert (d.kind, d.group, d.group_size, d.rebuilds) == (kind, group, size, rebuilds)


@pytest.mark.parametrize(("rebuilds", "kept"), [(False, False), (True, False), (True, True),
                                               (False, True)])
def test_a_declaration_round_trips(rebuilds: bool, kept: bool) -> None:
    layout = group_of([D("replicate", 2, 1, False), D("shard", 2, 0, True)], 4)
    d = read_declaration(declaration(layout, rebuilds=rebuilds, kept=kept))
    assert (d.kind, d.group, d.group_size, d.rebuilds, d.kept) == \
        ("hybrid", "shard=0", 2, rebuilds, kept)


@pytest.mark.parametrize(("ranks", "dim", "groups"), [
    ([[0, 1], [2, 3]], 0, [[0, 2], [1, 3]]),            # HSDP (replicate, shard) 2x2
    ([[0, 1, 2, 3], [4, 5, 6, 7]], 0, [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ([[0, 1], [2, 3], [4, 5]], 1, [[0, 1], [2, 3], [4, 5]]),  # (shard, replicate)
])
def test_replica_groups_of_a_mesh(ranks: list[list[int]], dim: int,
                                  groups: list[list[int]]) -> None:
    assert replica_groups(ranks, dim) == groups


def test_what_a_rank_holds_names_the_shard_and_how_many_there_are() -> None:
    hsdp = group_of([D("replicate", 2, 1, False), D("shard", 2, 0, True)], 4)
    one_replica = group_of([D("replicate", 1, 0, False), D("shard", 2, 0, True)], 2)
    fsdp = group_of([D("shard", 4, 0, True)], 4)
    assert holding(hsdp) == holding(one_replica) == "shard=0 of 2"  # re-meshed, same shard
    assert holding(fsdp) == "shard=0 of 4"  # shard 0 of 4 is not shard 0 of 2
    assert holding(group_of([], 4)) == "dp"
