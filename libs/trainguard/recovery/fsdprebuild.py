"""An FSDP2 model that survives an in-place re-form (``trainguard.torch.fsdp(build, guard,
mesh=...)``).

``fully_shard`` binds a module to its ``DeviceMesh``, and the mesh's process groups die with
the group an in-place recovery tears down; no public API moves a sharded module to another
mesh. So :class:`InPlaceFSDP` builds it again: at teardown it keeps each parameter's and
buffer's local part and the optimizer's state by parameter name; on the re-formed group it
asks the trainer's ``build(mesh)`` for the module on a new mesh, under
``torch.device("meta")`` (no initialisation is run), allocates it where the old one lived
and copies the local parts back. The trainer's optimizer keeps working: its parameter groups
and state are pointed at the new parameters, its DTensor moments placed on the new mesh
(no copy). A replacement rank builds once, normally; its shard comes from a rank of its
replica group (:func:`trainguard.recovery.statesync.share_state`).

The rebuild holds the parameters twice for a moment (kept and new); the optimizer state,
usually twice the parameters, is not copied.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .handle import GuardHandle
from .sharding import local_part, placed_like

Build = Callable[[Any], nn.Module]
"""The trainer's ``build(mesh)``: the model, ``fully_shard`` applied on ``mesh``."""
MakeMesh = Callable[[], Any]
"""Makes the job's ``DeviceMesh`` on the current default group (``init_device_mesh``)."""


@dataclass
class _Kept:
    """A survivor's local state between teardown and rebuild, by parameter name."""

    device: torch.device
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    groups: list[list[str]] = field(default_factory=list)
    """The optimizer's parameter groups, as names."""
    state: dict[str, dict[str, tuple[Any, bool]]] = field(default_factory=dict)
    """The optimizer's state per parameter: ``(value, was a DTensor)``."""


class InPlaceFSDP(nn.Module):
    """The trainer's FSDP2 model, built again on the new mesh after an in-place re-form.

    Args:
        build: ``build(mesh)`` returns the model with ``fully_shard`` applied on ``mesh``
            (and its initial values). On a re-form it runs under ``torch.device("meta")``:
            the values it would set are replaced by the rank's own.
        guard: the rank's Guard (with ``trainguard.torch.init_process_group`` installed);
            ``guard.attach(model, optimizer)`` names the optimizer that follows the model.
        mesh: makes the job's mesh on the current group, sized by it, e.g. ``lambda:
            init_device_mesh("cuda", (dist.get_world_size() // 8, 8),
            mesh_dim_names=("replicate", "shard"))``, so a group that shrank or grew in
            place gets fewer or more replicas. An HSDP mesh (a replicate dimension) is what
            lets a lost rank's shard come from its replica in place; without one the group
            restarts from the checkpoint.

    ``module`` is the current FSDP2 module (``state_dict()`` keys start with ``module.``);
    ``mesh`` the current mesh.
    """

    def __init__(self, build: Build, guard: GuardHandle, *, mesh: MakeMesh) -> None:
        super().__init__()
        self._build = build
        self._make_mesh = mesh
        self._guard = guard
        self._kept: _Kept | None = None
        self.mesh = mesh()
        self.module = build(self.mesh)
        self.builds = 1
        if guard.recovery is not None:
            guard.recovery.on_teardown(self.release)
            guard.recovery.on_regroup(self.rebuild, rebuilds_model=True)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def release(self) -> None:
        """Keep this rank's local state and drop the module (and with it the old mesh's
        groups). A failure in backward can leave blocks unsharded: ``reshard()`` (local,
        no collective) puts every parameter back to its shard first."""
        _reshard(self.module)
        names = {id(p): n for n, p in self.module.named_parameters()}
        params = {n: local_part(p) for n, p in self.module.named_parameters()}
        device = next(iter(params.values())).device if params else torch.device("cpu")
        kept = _Kept(device=device, params=params,
                     buffers={n: local_part(b) for n, b in self.module.named_buffers()})
        optimizer = self._guard.optimizer
        if optimizer is not None:
            kept.groups = [[names[id(p)] for p in group["params"]]
                           for group in optimizer.param_groups]
            kept.state = {names[id(p)]: {k: (local_part(v) if isinstance(v, torch.Tensor) else v,
                                             _is_dtensor(v)) for k, v in state.items()}
                          for p, state in optimizer.state.items()}
            optimizer.state.clear()
            for group in optimizer.param_groups:
                group["params"] = []
        meshes = [weakref.ref(m) for m in _meshes(self.module)]
        self._kept = kept
        self.module = nn.Module()
        self.mesh = None
        forget_meshes()
        gc.collect()
        if any(ref() is not None for ref in meshes):
            # Its groups' sockets stay open: a peer blocked on this rank would wait out its
            # collective timeout. Exiting closes them; the group restarts from the checkpoint.
            raise RuntimeError(
                "the old mesh outlives the teardown (something still holds the failed step's "
                "autograd graph, such as the loss in the training loop's own frame: keep "
                "forward and backward in a function), so its groups cannot be closed")

    def rebuild(self) -> None:
        """Build the model on the re-formed group's mesh and put this rank's state back."""
        kept, self._kept = self._kept, None
        if kept is None:  # every re-form tears down (and so releases) first
            raise RuntimeError("rebuild without a release: nothing was kept to rebuild from")
        mesh = self._make_mesh()
        with torch.device("meta"):
            module = self._build(mesh)
        module.to_empty(device=kept.device)
        with torch.no_grad():
            for name, param in module.named_parameters():
                _copy(local_part(param), kept.params, name)
            for name, buf in module.named_buffers():
                _copy(local_part(buf), kept.buffers, name)
        optimizer = self._guard.optimizer
        if optimizer is not None:
            new = dict(module.named_parameters())
            for group, names in zip(optimizer.param_groups, kept.groups, strict=True):
                group["params"] = [new[n] for n in names]
            for name, state in kept.state.items():
                param = new[name]
                optimizer.state[param] = {k: placed_like(v, param) if was_dtensor else v
                                          for k, (v, was_dtensor) in state.items()}
        self.mesh, self.module = mesh, module
        self.builds += 1


def _reshard(module: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


def _meshes(module: nn.Module) -> list[Any]:
    """The distinct meshes of ``module``'s DTensor parameters."""
    from torch.distributed.tensor import DTensor

    found: dict[int, Any] = {}
    for p in module.parameters():
        if isinstance(p, DTensor):
            found.setdefault(id(p.device_mesh), p.device_mesh)
    return list(found.values())


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _copy(into: torch.Tensor, kept: dict[str, torch.Tensor], name: str) -> None:
    have = kept.get(name)
    if have is None or have.shape != into.shape:
        raise RuntimeError(
            f"build(mesh) made {name!r} with a local shape {tuple(into.shape)} where this rank "
            f"kept {None if have is None else tuple(have.shape)}: it must build the same "
            "model on the same mesh")
    into.copy_(have)


def fsdp(build: Build, guard: GuardHandle, *, mesh: MakeMesh) -> InPlaceFSDP:
    """The FSDP2 model ``build(mesh())`` makes, rebuilt on the new group after an in-place
    re-form (:class:`InPlaceFSDP`)."""
    return InPlaceFSDP(build, guard, mesh=mesh)


def forget_meshes() -> None:
    """Drop DTensor's caches that hold meshes. They key op placements, redistribution plans
    and mesh topologies on specs and meshes, and a mesh holds its process groups: cached,
    the old groups outlive the teardown with their sockets open (a peer blocked on this
    rank then waits out its collective timeout), and a new mesh over the same ranks, equal
    to the old one, would be handed the old one's plans. torch offers
    ``torch.distributed.tensor.debug._clear_sharding_prop_cache`` as the way to clear the
    first; the others have no public clear, so each is cleared only where this torch has
    it, and :meth:`InPlaceFSDP.release` checks that the old mesh is gone."""
    from torch.distributed.tensor import _collective_utils, _redistribute, debug

    clears: list[Callable[[], Any]] = [
        getattr(debug, "_clear_sharding_prop_cache", _absent),
        getattr(_redistribute, "clear_redistribute_planner_cache", _absent),
        getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", _absent),
        getattr(getattr(getattr(_collective_utils, "MeshTopoInfo", None), "build_from_mesh",
                        None), "cache_clear", _absent),
    ]
    for clear in clears:
        clear()


def _absent() -> None:
    return None
