"""Which ranks hold the same training state: read from the model's DTensor placements.

Everything that compares or moves state between ranks asks this first. Parameter
fingerprints are compared only within a replica group (ranks holding bit-equal state), a
replacement takes its state only from a rank of its own group, and a checkpoint records the
layout it was saved from (:class:`~trainguard.contract.schemas.Topology`).

A parameter that is a DTensor names its mesh and one placement per mesh dimension: along a
``Shard``/``Partial`` dimension ranks hold different parts, along a ``Replicate`` dimension
the same. Plain tensors are full replicas. Ranks outside a parameter's mesh dimensions (TP
on a sub-mesh with plain DDP around it) are replicas too, which is why a group's size is
the world over the sharded dimensions' sizes, not the mesh's replicate dimensions.

:func:`group_of` is the rule, pure and tested as a table; :func:`layout_of` reads a model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast, get_args

from trainguard.contract.schemas import StateKind, Topology

WHOLE_JOB = "dp"
"""The replica group of a job whose state is not sharded: every rank (the fingerprint's
default, so older clients and replicated jobs compare the same way)."""


@dataclass(frozen=True)
class MeshDim:
    """One named dimension of the meshes a model's parameters live on, seen from a rank."""

    name: str
    size: int
    coordinate: int | None
    """This rank's index along it (None: the rank is not on that mesh)."""
    sharded: bool


@dataclass(frozen=True)
class Layout:
    """A rank's view of the job's state layout."""

    topology: Topology
    group: str
    """This rank's replica group: ranks with the same group hold bit-equal state."""

    @property
    def group_size(self) -> int:
        return self.topology.replicas


def holding(layout: Layout) -> str:
    """Which part of the state a rank holds: its replica group with the sizes of the
    sharded dimensions (shard 0 of 2 is not shard 0 of 4). A rank whose holding changed
    across a re-form took its kept state to the wrong place."""
    t = layout.topology
    if not t.sharded_dims:
        return layout.group
    sizes = dict(zip(t.mesh_dims, t.mesh_shape, strict=True))
    return f"{layout.group} of " + "x".join(str(sizes[d]) for d in t.sharded_dims)


def group_of(dims: Iterable[MeshDim], world_size: int) -> Layout:
    """The layout ``dims`` describe, for the rank whose coordinates they carry."""
    dims = list(dims)
    sharded = [d for d in dims if d.sharded]
    replicas = max(1, world_size // math.prod(d.size for d in sharded))
    kind: StateKind = "replicated" if not sharded else "sharded" if replicas == 1 else "hybrid"
    group = ",".join(f"{d.name}={d.coordinate if d.coordinate is not None else '-'}"
                     for d in sharded) or WHOLE_JOB
    topology = Topology(world_size=world_size, kind=kind, mesh_shape=[d.size for d in dims],
                        mesh_dims=[d.name for d in dims], sharded_dims=[d.name for d in sharded],
                        replicas=replicas)
    return Layout(topology=topology, group=group)


def mesh_dims(params: Iterable[Any]) -> list[MeshDim]:
    """The named mesh dimensions of the DTensor ``params``, merged by name (FSDP with TP puts
    some parameters on the 2-D mesh and the rest on its ``dp`` sub-mesh); a dimension is
    sharded if any parameter is sharded (or partial) along it."""
    from torch.distributed.tensor import DTensor

    seen: dict[str, MeshDim] = {}
    for p in params:
        if not isinstance(p, DTensor):
            continue
        mesh = p.device_mesh
        names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
        coordinate = mesh.get_coordinate()
        for i, (name, placement) in enumerate(zip(names, p.placements, strict=True)):
            split = placement.is_shard() or placement.is_partial()
            old = seen.get(name)
            seen[name] = MeshDim(name=name, size=int(mesh.size(i)),
                                 coordinate=coordinate[i] if coordinate is not None else None,
                                 sharded=split or (old is not None and old.sharded))
    return list(seen.values())


def layout_of(model: Any, world_size: int) -> Layout:
    """The layout of ``model``'s parameters (a module, or an iterable of tensors)."""
    params = model.parameters() if hasattr(model, "parameters") else model
    return group_of(mesh_dims(params), world_size)


REBUILDS = "rebuilds"
"""The declaration's last word when the rank's sharded model is built again on a re-formed
group (``trainguard.torch.fsdp``): only then can it take a shard from a replica in place."""


KEPT = "kept"
"""The declaration's word when the rank's sharded model (no replica) is built again on a
re-formed group and its shard is also kept in memory on another host (buddy copies): a
lost rank is replaced in place from it (a resize is not: it would reshard)."""


def declaration(layout: Layout, *, rebuilds: bool = False, kept: bool = False) -> str:
    """What a rank writes as its in-place key: how its state is laid out, which ranks hold
    the same, whether its sharded model can be rebuilt in place and whether its shard is
    kept elsewhere, so an agent can tell whether a lost rank's state survives elsewhere and
    can be handed over."""
    words = [layout.topology.kind, str(layout.group_size), layout.group]
    return " ".join(words + [REBUILDS] * rebuilds + [KEPT] * kept)


@dataclass(frozen=True)
class Declared:
    """A rank's in-place key, read back."""

    kind: StateKind
    group: str
    group_size: int
    rebuilds: bool = False
    kept: bool = False
    """The shard is kept in memory on another host too (:data:`KEPT`)."""


def read_declaration(raw: bytes | str) -> Declared:
    """``"1"`` (a trainguard before this, replicated by construction) reads as the whole
    job; anything unreadable as sharded state held by no one else (the safe answer)."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    parts = text.split()
    if parts == ["1"]:
        return Declared(kind="replicated", group=WHOLE_JOB, group_size=0)
    flags = parts[3:]
    try:
        if set(flags) - {REBUILDS, KEPT}:
            raise ValueError(f"unknown words {flags}")
        kind, size, group = parts[:3]
        if kind in get_args(StateKind):
            return Declared(kind=cast(StateKind, kind), group=group, group_size=int(size),
                            rebuilds=REBUILDS in flags, kept=KEPT in flags)
    except ValueError:
        pass
    return Declared(kind="sharded", group=f"unreadable:{text[:40]}", group_size=1)


def local_part(tensor: Any) -> Any:
    """The part of ``tensor`` this rank holds, outside autograd and writable in place (it
    shares the storage): a DTensor's local shard, else the tensor's data."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local().detach() if isinstance(tensor, DTensor) else tensor.data


def placed_like(local: Any, param: Any) -> Any:
    """``local`` (this rank's part of a tensor shaped like ``param``) as a DTensor placed like
    ``param``: its mesh, placements, global shape and stride (an optimizer moment of an FSDP2
    parameter, received or kept across a rebuild)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape,
                              stride=param.stride())


def replica_dim(params: Iterable[Any]) -> tuple[Any, int] | None:
    """The mesh and dimension along which every DTensor of ``params`` is replicated: its
    groups are the replica groups a shard is handed over in (HSDP's ``replicate``). None
    when no parameter is a DTensor (the whole job is one replica group). Raises ValueError
    where the replicas are not one dimension of one mesh (a sharded state without replicas,
    or TP on a sub-mesh with DDP around it): no in-place hand-over is built for those."""
    from torch.distributed.tensor import DTensor

    mesh: Any = None
    replicated: set[int] | None = None
    for p in params:
        if not isinstance(p, DTensor):
            continue
        if mesh is None:
            mesh = p.device_mesh
        elif p.device_mesh != mesh:
            raise ValueError("the parameters live on more than one mesh")
        dims = {i for i, placement in enumerate(p.placements) if placement.is_replicate()}
        replicated = dims if replicated is None else replicated & dims
    if mesh is None:
        return None
    if not replicated or len(replicated) > 1 or mesh.ndim != 2:
        raise ValueError(f"the state is replicated along {len(replicated or ())} dimension(s) "
                         "of its mesh: a shard is handed over along exactly one")
    return mesh, replicated.pop()


def replica_groups(ranks: Sequence[Sequence[int]], dim: int) -> list[list[int]]:
    """The replica groups of a 2-D mesh of global ``ranks`` along ``dim``: the ranks that
    differ only in their ``dim`` coordinate."""
    if dim == 0:
        return [[row[j] for row in ranks] for j in range(len(ranks[0]))]
    return [list(row) for row in ranks]


def holders(declared: Mapping[int, Declared], lost: int) -> list[int]:
    """The other ranks that hold ``lost``'s state: the ones that declared its group."""
    mine = declared.get(lost)
    if mine is None:
        return []
    return sorted(r for r, d in declared.items() if r != lost and d.group == mine.group)
