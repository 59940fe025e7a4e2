"""Incremental checkpoints: which tensors a save can leave to the last full one.

Each rank hashes every tensor of its model and optimizer state (XXH3-128 of its bytes,
with dtype and shape; a DTensor's local shard), and compares the hash with the one taken
at the last full save (the *base*). The ranks then agree (:func:`decide`): a tensor is
left out only where it is unchanged on every rank, so every rank writes the same keys and
DCP's plan stays the same on all of them; any disagreement about the base makes a full
save. Each increment is taken against the base, never against the previous increment, so a
restore reads at most two checkpoints, and a full save every ``every`` increments keeps the
part an increment writes from growing as more of the state drifts from the base.

Pure parts here (hashing, the decision, cutting state dicts); the Checkpointer runs them.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

ROOTS = ("model", "optim")
"""The parts of a save whose tensors may be left to the base: RNG states, ``extra`` and
the data position are small and always written."""


def _walk(node: Mapping[str, Any], prefix: str) -> Iterator[tuple[str, Any]]:
    for name, value in node.items():
        path = f"{prefix}.{name}" if prefix else str(name)
        if isinstance(value, Mapping):
            yield from _walk(value, path)
        else:
            yield path, value


def tensor_leaves(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors under :data:`ROOTS`, reached through dicts, by dot-joined path (lists,
    such as an optimizer's ``param_groups``, are always written). A path two leaves share
    (a key with a dot in it) is left out: those are always written too."""
    found: dict[str, torch.Tensor] = {}
    shared: set[str] = set()
    for root in ROOTS:
        node = state.get(root)
        if not isinstance(node, Mapping):
            continue
        for path, value in _walk(node, root):
            if path in found or path in shared:
                shared.add(path)
                found.pop(path, None)
            elif isinstance(value, torch.Tensor):
                found[path] = value
    return found


def tensor_digest(tensor: torch.Tensor) -> bytes:
    """XXH3-128 of a tensor's bytes, dtype and shape; of a DTensor, its local shard. A tensor
    off the CPU is copied to it first. One whose bytes cannot be viewed (sparse, quantized)
    gets a digest of its own each time: it is always written."""
    to_local = getattr(tensor, "to_local", None)
    local = (to_local() if callable(to_local) else tensor).detach()
    try:
        if local.device.type != "cpu":
            local = local.cpu()
        h = xxhash.xxh3_128(f"{local.dtype} {tuple(local.shape)}".encode())
        if local.numel():
            h.update(local.contiguous().reshape(-1).view(torch.uint8).numpy().data)
    except (RuntimeError, TypeError, NotImplementedError):
        return os.urandom(16)
    return h.digest()


def digests(state: Mapping[str, Any]) -> dict[str, bytes]:
    return {key: tensor_digest(t) for key, t in tensor_leaves(state).items()}


@dataclass(frozen=True)
class RankView:
    """What one rank brings to the decision: its base and the keys it saw change."""

    base: int | None
    increments: int
    """Increments saved on this base so far."""
    keys: int
    """How many tensor keys this rank holds (every rank of one job holds the same)."""
    changed: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Decision:
    base: int | None
    """The base step; None: a full save."""
    held: dict[str, int] = field(default_factory=dict)
    """Keys left out of this save -> the step holding them."""
    why_full: str = ""


def decide(views: Sequence[RankView], every: int, keys: Collection[str]) -> Decision:
    """The save every rank makes, from every rank's view (the same on all of them)."""
    if every < 1:
        return Decision(None, why_full="incremental saves are off")
    bases = {v.base for v in views}
    if len(bases) != 1 or None in bases:
        return Decision(None, why_full="no common base" if len(bases) != 1 else "no base yet")
    if max(v.increments for v in views) >= every:
        return Decision(None, why_full=f"{every} increments since the base")
    if len({v.keys for v in views}) != 1:
        return Decision(None, why_full="ranks hold different tensor keys")
    changed = set().union(*(v.changed for v in views))
    base = bases.pop()
    assert base is not None
    held = {k: base for k in sorted(keys) if k not in changed}
    if not held:  # an increment of everything would only tie the restore to the base
        return Decision(None, why_full="every tensor changed")
    return Decision(base, held)


class Chain:
    """This rank's memory of its base: the digests of the last full save that succeeded
    here, and how many increments followed it. Forgotten at a load: the state came from
    elsewhere, and the next save starts a new chain."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.base: int | None = None
        self.base_digests: dict[str, bytes] = {}
        self.increments = 0
        self._pending: tuple[int, Decision, dict[str, bytes]] | None = None

    def view(self, now: Mapping[str, bytes]) -> RankView:
        changed = [k for k, d in now.items() if self.base_digests.get(k) != d] \
            if self.base is not None else []
        return RankView(self.base, self.increments, len(now), changed)

    def saving(self, step: int, decision: Decision, now: dict[str, bytes]) -> None:
        self._pending = (step, decision, now)

    def saved(self, ok: bool) -> None:
        """The save begun last ended: a full one that succeeded becomes the base; a failed
        full save leaves no base (its files may be incomplete)."""
        if self._pending is None:
            return
        step, decision, now = self._pending
        self._pending = None
        if decision.base is None:
            if ok:
                self.base, self.base_digests, self.increments = step, now, 0
            else:
                self.forget()
        elif ok:
            self.increments += 1

    def forget(self) -> None:
        self.base, self.base_digests, self.increments = None, {}, 0
        self._pending = None


def without(state: Mapping[str, Any], keys: Collection[str], prefix: str = "") -> dict[str, Any]:
    """A copy of the nested dicts of ``state`` without the leaves at ``keys`` (the leaves
    themselves are shared, not copied)."""
    out: dict[str, Any] = {}
    for name, value in state.items():
        path = f"{prefix}.{name}" if prefix else str(name)
        if isinstance(value, Mapping):
            out[name] = without(value, keys, path)
        elif path not in keys:
            out[name] = value
    return out


def only(state: Mapping[str, Any], keys: Collection[str], prefix: str = "") -> dict[str, Any]:
    """The nested dicts of ``state`` holding only the leaves at ``keys`` (shared)."""
    out: dict[str, Any] = {}
    for name, value in state.items():
        path = f"{prefix}.{name}" if prefix else str(name)
        if isinstance(value, Mapping):
            inner = only(value, keys, path)
            if inner:
                out[name] = inner
        elif path in keys:
            out[name] = value
    return out


def graft(into: dict[str, Any], part: Mapping[str, Any]) -> dict[str, Any]:
    """``into`` with the leaves of ``part`` put in their places (in place; returned)."""
    for name, value in part.items():
        if isinstance(value, Mapping) and isinstance(into.get(name), dict):
            graft(into[name], value)
        else:
            into[name] = value
    return into
