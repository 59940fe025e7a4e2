"""The state agreement of a re-formed group: who is the source, and its state to everyone.

Every rank contributes its last completed step (a replacement: none). The source is the
lowest rank among those with the highest completed step; it broadcasts the model's
parameters and buffers (in place, tensor by tensor), the optimizer state, the torch RNG
state (CPU, and CUDA where the source uses it) and the step; every rank takes the highest
command sequence, the source's checkpoint interval and the commands it holds for a later
step (:class:`CommandState`). The optimizer's structure goes as msgspec MessagePack (no
pickle crosses the wire), its tensors as tensors.

Sharded state (HSDP) is shared within each replica group only (:func:`source_within`, the
``group`` of :func:`share_state`): a rank's shard comes from a rank holding the same shard,
and a DTensor travels as its local part, wrapped again on the receiver like its parameter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Final, Protocol

import msgspec
import torch
import torch.distributed as dist

from trainguard.contract.codec import decode_durable, encode_durable
from trainguard.contract.schemas import Command

from .loop import CommandState
from .sharding import local_part, placed_like

JOINER: Final = -(2**62)
"""The completed step a replacement contributes: below any real step, -1 included."""
_NONE: Final = -(2**62)


@dataclass(frozen=True)
class StateAgreement:
    """What the ranks agreed on: the source and the group's progress."""

    source: int
    completed: int
    """The source's last completed step (``start - 1`` if none completed since it began)."""
    joined: list[int]
    """Ranks with nothing to contribute (replacements)."""
    failed_step: int | None
    """The highest step any rank abandoned."""
    failure_time: float | None
    """The earliest moment a rank saw the failure (unix time)."""
    command_state: CommandState
    """The highest command sequence; the source's checkpoint interval and held commands."""
    steps: tuple[int, ...] = ()
    """Every rank's last completed step (:data:`JOINER` for a replacement)."""


def source_within(agreed: StateAgreement, members: list[int]) -> int:
    """The source for the ranks ``members`` (a replica group): the lowest of them at the
    group's step. Raises where none of them reached it (their state is not the job's)."""
    ready = [r for r in members if agreed.steps[r] == agreed.completed]
    if not ready:
        raise RuntimeError(f"no rank of the replica group {members} completed step "
                           f"{agreed.completed}: its state cannot be shared")
    return min(ready)


def agree(completed: int | None, failed_step: int | None, failure_time: float | None,
          commands: CommandState, device: torch.device) -> StateAgreement:
    """All-gather every rank's contribution; the same answer on every rank."""
    world = dist.get_world_size()
    mine = torch.tensor([JOINER if completed is None else completed,
                         _NONE if failed_step is None else failed_step,
                         _NONE if failure_time is None else int(failure_time * 1e6),
                         commands.command_seq, commands.checkpoint_every,
                         commands.checkpoint_from], dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine)
    table = [[int(v) for v in row.tolist()] for row in rows]
    best = max(r[0] for r in table)
    if best == JOINER:
        raise RuntimeError("no rank of the re-formed group has a state to share")
    source = min(i for i, r in enumerate(table) if r[0] == best)
    failed = [r[1] for r in table if r[1] != _NONE]
    times = [r[2] for r in table if r[2] != _NONE]
    held = _Sender(source, device, None).blob(
        msgspec.msgpack.encode([encode_durable(c) for c in commands.scheduled])
        if dist.get_rank() == source else None)
    scheduled = tuple(decode_durable(raw, Command)
                      for raw in msgspec.msgpack.decode(held, type=list[bytes]))
    return StateAgreement(source=source, completed=best,
                     joined=[i for i, r in enumerate(table) if r[0] == JOINER],
                     failed_step=max(failed) if failed else None,
                     failure_time=min(times) / 1e6 if times else None,
                     command_state=CommandState(command_seq=max(r[3] for r in table),
                                                checkpoint_every=table[source][4],
                                                checkpoint_from=table[source][5],
                                                scheduled=scheduled),
                          steps=tuple(r[0] for r in table))


def share_state(model: Any, optimizer: Any, source: int, device: torch.device,
                group: Any = None) -> float:
    """Make every rank's model, optimizer and RNG state the source's; returns the seconds it
    took. Collective over ``group`` (default: the whole group): every member calls it with
    the same ``source`` (a global rank)."""
    t0 = time.perf_counter()
    me = dist.get_rank()
    send = _Sender(source, device, group)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            send.tensor(local_part(tensor))
    _share_optimizer(optimizer, send, me == source)
    _share_rng(send, me == source)
    return time.perf_counter() - t0


class Stream(Protocol):
    """A per-rank stream position that follows the state (``trainguard.torch.Batches``)."""

    def position_before(self, step: int) -> bytes | None: ...

    def encoded(self) -> bytes:
        """The position now."""
        ...

    def rewind(self, step: int, shared: bytes | None) -> None: ...


def share_streams(streams: list[Stream], step: int, source: int, device: torch.device,
                  joined: bool) -> None:
    """Every stream goes on at ``step``: a survivor from its own position, a rank without
    one (a replacement, ``joined``) from the source's. Collective when any rank joined
    (``joined`` is the agreement's, the same on every rank): the source broadcasts."""
    me = dist.get_rank()
    for stream in streams:
        own = stream.position_before(step)
        shared = None
        if joined:
            send = _Sender(source, device, None)
            shared = send.blob((own if own is not None else stream.encoded())
                               if me == source else None)
        stream.rewind(step, shared)


@dataclass(frozen=True)
class _Sender:
    """Broadcasts from ``source`` over ``group``, through ``device`` where the backend cannot
    send a tensor where it is (NCCL: CPU tensors go through the GPU)."""

    source: int
    device: torch.device
    group: Any

    def tensor(self, tensor: torch.Tensor) -> None:
        """In place."""
        if tensor.device.type == self.device.type:
            dist.broadcast(tensor, self.source, group=self.group)
            return
        carrier = tensor.to(self.device)
        dist.broadcast(carrier, self.source, group=self.group)
        tensor.copy_(carrier)

    def blob(self, data: bytes | None) -> bytes:
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64,
                            device=self.device)
        dist.broadcast(size, self.source, group=self.group)
        if data is not None:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        else:
            buf = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        dist.broadcast(buf, self.source, group=self.group)
        return data if data is not None else bytes(buf.cpu().numpy().tobytes())


class _Spec(msgspec.Struct, array_like=True):
    dtype: str
    shape: list[int]
    device: str


def _share_optimizer(optimizer: Any, send: _Sender, is_source: bool) -> None:
    """The optimizer's ``state_dict()``: structure as MessagePack with tensor placeholders,
    then each tensor. Receivers load it with ``load_state_dict`` (a fresh optimizer has
    no state entries, so copying in place would not do)."""
    if optimizer is None:
        return
    tensors: list[torch.Tensor] = []
    blob = None
    if is_source:
        skeleton = _strip(optimizer.state_dict(), tensors)
        blob = msgspec.msgpack.encode(
            {"sd": skeleton, "specs": [_Spec(str(t.dtype).removeprefix("torch."),
                                             list(t.shape), t.device.type) for t in tensors]})
    decoded = msgspec.msgpack.decode(send.blob(blob))
    if is_source:
        for t in tensors:
            send.tensor(t.detach())
        return
    specs = msgspec.convert(decoded["specs"], list[_Spec])
    for spec in specs:
        where = send.device if spec.device == send.device.type else torch.device(spec.device)
        t = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype), device=where)
        send.tensor(t)
        tensors.append(t)
    _like_params(decoded["sd"], tensors, optimizer)
    state = _fill(decoded["sd"], tensors)
    _keep_tuples(state["param_groups"], optimizer.state_dict()["param_groups"])
    state["state"] = {int(k): v for k, v in state["state"].items()}
    optimizer.load_state_dict(state)


_TENSOR: Final = "__trainguard_tensor__"
_DTENSOR: Final = "__trainguard_dtensor__"
"""Marks a placeholder whose tensor was a DTensor: it is wrapped like its parameter."""


def _like_params(skeleton: dict[str, Any], tensors: list[torch.Tensor],
                 optimizer: Any) -> None:
    """Wrap the received local parts of DTensor optimizer state (AdamW's moments of an FSDP2
    parameter) as DTensors placed like their parameter on this rank's mesh."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, entry in skeleton["state"].items():
        param = params[int(index)]
        for value in entry.values():
            if isinstance(value, dict) and value.get(_DTENSOR):
                i = value[_TENSOR]
                tensors[i] = placed_like(tensors[i], param)


def _strip(obj: Any, out: list[torch.Tensor]) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        out.append(obj.to_local())
        return {_TENSOR: len(out) - 1, _DTENSOR: True}
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        return {_TENSOR: len(out) - 1}
    if isinstance(obj, dict):
        return {str(k) if isinstance(k, int) else k: _strip(v, out) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_strip(v, out) for v in obj]
    return obj


def _fill(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if _TENSOR in obj:
            return tensors[obj[_TENSOR]]
        return {k: _fill(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fill(v, tensors) for v in obj]
    return obj


def _keep_tuples(received: list[dict[str, Any]], own: list[dict[str, Any]]) -> None:
    """MessagePack has no tuples: where this rank's own group holds one (Adam's
    ``betas``), the received list becomes one again."""
    for got, mine in zip(received, own, strict=False):
        for key, value in mine.items():
            if isinstance(value, tuple) and isinstance(got.get(key), list):
                got[key] = tuple(got[key])


def _share_rng(send: _Sender, is_source: bool) -> None:
    cpu = torch.get_rng_state()
    send.tensor(cpu)
    if not is_source:
        torch.set_rng_state(cpu)
    uses_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    # CUDA generators: one state per device, sent as bytes (the ranks' device counts agree
    # on a data-parallel job; a rank without CUDA keeps its own).
    states = torch.stack(torch.cuda.get_rng_state_all()) if is_source and uses_cuda else None
    data = send.blob(msgspec.msgpack.encode(
        [] if states is None else [bytes(s.numpy().tobytes()) for s in states])
        if is_source else None)
    received = msgspec.msgpack.decode(data, type=list[bytes])
    if not is_source and received and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.frombuffer(bytearray(b), dtype=torch.uint8)
                                      for b in received])
