"""Tensor statistics for the Guard: gradient norm, non-finite checks, fingerprints.

All return tensors on the parameters' device and never call ``.item()``: the Guard
reads them later without a host sync (see :mod:`trainguard.client.values`). The few
helpers that must look at values (``nonfinite_grad_origin``, ``largest_grad_norms``,
``check_batch``) say so and run only when something is already wrong or when the trainer
asks.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainguard.recovery.sharding import Layout, layout_of

ParamsLike = nn.Module | Iterable[torch.Tensor]


def _params(model_or_params: ParamsLike) -> Iterator[torch.Tensor]:
    if isinstance(model_or_params, nn.Module):
        return iter(model_or_params.parameters())
    return iter(model_or_params)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP2, tensor parallel); a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def state_layout(model_or_params: ParamsLike) -> Layout:
    """Which ranks hold the same state as this one (:mod:`trainguard.recovery.sharding`)."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return layout_of(list(_params(model_or_params)), world)


def grad_norm(model_or_params: ParamsLike, norm_type: float = 2.0) -> torch.Tensor:
    """Total gradient norm, as ``clip_grad_norm_`` computes it, in fused kernels.

    One ``torch._foreach_norm`` per (device, dtype) group, then one norm of the norms: no
    per-parameter ``.item()``. Returns a 0-dim tensor on the first gradient's device.
    """
    grads = [p.grad for p in _params(model_or_params) if p.grad is not None]
    if not grads:
        return torch.zeros(())
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        groups[(g.device, g.dtype)].append(g.detach())
    device = grads[0].device
    norms: list[torch.Tensor] = []
    for tensors in groups.values():
        norms.extend(n.to(device) for n in torch._foreach_norm(tensors, norm_type))
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]),
                                                   norm_type)
    return total


def nonfinite(value: torch.Tensor | float) -> torch.Tensor | bool:
    """True where ``value`` has a NaN or Inf: a bool for numbers, a 0-dim bool tensor
    (no sync) for tensors."""
    if isinstance(value, torch.Tensor):
        return ~torch.isfinite(value.detach()).all()
    return not math.isfinite(value)


def _named_grads(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, this rank's part of the gradient) of each parameter that has one, in
    registration order. A DTensor gradient is its local shard: no collective runs."""
    return [(name, _local(p.grad.detach())) for name, p in model.named_parameters()
            if p.grad is not None]


def _host_values(values: list[torch.Tensor]) -> list[Any]:
    """0-dim tensors (on any devices) read back with one copy per device."""
    if not values:
        return []
    device = values[0].device
    return torch.stack([v.to(device) for v in values]).tolist()


def _backward_order(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """``named`` (registration order) in the order backward reaches it: modules last
    registered first, a module's own parameters in their order (``weight``, ``bias``)."""
    modules: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for item in named:
        modules.setdefault(item[0].rpartition(".")[0], []).append(item)
    return [item for group in reversed(modules.values()) for item in group]


@dataclass
class GradOrigin:
    """Where a step's non-finite gradients started (:func:`nonfinite_grad_origin`).

    ``basis`` says how ``names[0]`` was chosen:

    * ``parameter``: that parameter itself holds NaN/Inf (every step through it then
      fails; the other names are parameters that hold NaN/Inf too).
    * ``backward``: the first parameter, in backward order, whose gradient is non-finite;
      the gradients backward reached before it are finite, so the bad value was born
      there (in that layer's backward, or its forward output).
    * ``forward``: every gradient is non-finite, so the values were bad before backward
      began (an activation overflowed in the forward pass, the loss, or the input): the
      name is only the first one backward reached; ``count`` says how many went bad.
    """

    names: list[str] = field(default_factory=list)
    """Origin first, then the next ones in backward order (at most ``limit``)."""
    count: int = 0
    """Parameters whose gradient holds NaN/Inf (this rank's shard of them)."""
    total: int = 0
    """Parameters with a gradient."""
    basis: str = ""


def nonfinite_grad_origin(model: nn.Module, limit: int = 5) -> GradOrigin:
    """The parameter where a step's non-finite gradients started, and how many there are.

    A NaN born in the backward pass at layer *k* poisons the gradients of layer *k* and of
    every layer backward reaches after it (those before it in the forward pass), so the
    origin is the first non-finite gradient in *backward* order. Backward order is taken
    as the reverse of the parameters' registration order: the order backward reaches
    them wherever modules are registered in the order they run (the usual model); within
    one module its parameters keep their order (a layer is named by its ``weight``).

    Reads values, so it syncs the device (one copy back per device): the Guard calls it
    only once a step's gradient norm is already non-finite. Sharded parameters (DTensor)
    are judged by this rank's shard; no collective runs.
    """
    named = _backward_order(_named_grads(model))
    if not named:
        return GradOrigin()
    finite = _host_values([torch.isfinite(g).all() for _, g in named])
    bad = [name for (name, _), ok in zip(named, finite, strict=True) if not ok]
    origin = GradOrigin(count=len(bad), total=len(named))
    if not bad:
        return origin
    params = [(name, _local(p.detach())) for name, p in model.named_parameters()
              if p.is_floating_point() or p.is_complex()]
    held = _host_values([torch.isfinite(t).all() for _, t in params])
    broken = [name for (name, _), ok in zip(params, held, strict=True) if not ok]
    if broken:
        origin.names, origin.basis = broken[:limit], "parameter"
    else:
        origin.names = bad[:limit]
        origin.basis = "forward" if len(bad) == len(named) else "backward"
    return origin


def nonfinite_grad_names(model: nn.Module, limit: int = 5) -> list[str]:
    """Names of the parameters whose gradients hold NaN/Inf, where they started first
    (:func:`nonfinite_grad_origin`). Syncs the device: call it only on a bad step."""
    return nonfinite_grad_origin(model, limit).names


def largest_grad_norms(model: nn.Module, top: int = 3) -> dict[str, float]:
    """The ``top`` parameters with the largest gradient norms, largest first (name: norm).

    For a step whose total gradient norm exploded: the layers that carry it. Computes one
    norm per parameter (in float32) and reads them back, so it syncs the device: the Guard
    calls it only on such a step, never on a normal one. A DTensor gradient counts with
    this rank's shard (no collective).
    """
    named = _named_grads(model)
    if not named:
        return {}
    norms = _host_values([torch.linalg.vector_norm(g, dtype=torch.float32) for _, g in named])
    ranked = sorted(zip((n for n, _ in named), norms, strict=True), key=lambda kv: -kv[1]
                    if math.isfinite(kv[1]) else -math.inf)
    return {name: float(norm) for name, norm in ranked[:top]}


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(model_or_params: ParamsLike) -> torch.Tensor:
    """Integer checksum of parameters: each viewed as integers of its element size and
    summed in int64, on the device. Bit-exact replicas agree; one flipped bit changes it.

    A sharded parameter (DTensor) contributes this rank's part: compare the result only
    among ranks that hold the same parts (:func:`state_layout`'s group).
    """
    total: torch.Tensor | None = None
    for p in _params(model_or_params):
        t = _local(p.detach())
        if not t.is_contiguous():
            t = t.contiguous()
        part = t.view(_INT_VIEW[t.element_size()]).sum(dtype=torch.int64)
        total = part if total is None else total + part
    return total if total is not None else torch.zeros((), dtype=torch.int64)


def poison_with_nan(model: nn.Module) -> str:
    """The ``nan`` drill: fill the first floating parameter with NaN (every input then
    meets it, and the gradient all-reduce spreads it to every rank)."""
    for name, p in model.named_parameters():
        if p.is_floating_point():
            with torch.no_grad():
                _local(p.data).fill_(float("nan"))
            return name
    raise RuntimeError("the model has no floating-point parameter to poison")


def flip_bit(model: nn.Module, bit: int = 20) -> str:
    """The ``sdc`` drill: flip one bit of the first element of the first parameter."""
    for name, p in model.named_parameters():
        local = _local(p.data)  # a sharded parameter: this rank's part
        if local.element_size() in _INT_VIEW and local.numel():
            bits = local.element_size() * 8
            if not 0 <= bit < bits - 1:
                raise ValueError(f"bit {bit} out of range for {bits}-bit values")
            with torch.no_grad():
                view = local.view(-1).view(_INT_VIEW[local.element_size()])
                view[0] ^= 1 << bit
            return f"flipped bit {bit} of {name}[0]"
    raise RuntimeError("the model has no parameter to flip a bit in")
