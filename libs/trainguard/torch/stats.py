"""Tensor statistics for the Guard: gradient norm, non-finite checks, fingerprints.

All return tensors on the parameters' device and never call ``.item()``: the Guard
reads them later without a host sync (see :mod:`trainguard.client.values`). The few
helpers that must look at values (``nonfinite_grad_names``, ``check_batch``) say so and
run only when something is already wrong or when the trainer asks.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Iterator

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


def nonfinite_grad_names(model: nn.Module, limit: int = 5) -> list[str]:
    """Names of the first parameters whose gradients hold NaN/Inf.

    Syncs the device: the Guard calls it only once a step's gradient norm is already
    non-finite, to point at where the bad values start.
    """
    names: list[str] = []
    for name, p in model.named_parameters():
        if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
            names.append(name)
            if len(names) >= limit:
                break
    return names


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
