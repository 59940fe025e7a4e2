"""Batch checks: a bad batch is caught on its rank before the forward pass, and skipped.

A NaN in one rank's input reaches the loss, the all-reduce spreads it to every rank, and
the job reads as numerically diverged: rolled back, only to meet the same batch again. So
the data phase's output is checked where it is made (``batch = check(s, next(loader))``):

* :func:`check_batch` is the check itself, a pure function: no batch, an empty one,
  NaN/Inf, values beyond a bound, or a dtype or number of dimensions other than the
  first batch's. Finiteness costs one reduction per floating tensor (a sum: NaN and Inf
  survive it; only a non-finite sum, rare, pays the exact pass that names the row).
* :class:`BatchCheck` runs it every ``every``-th step (the same steps on every rank) and,
  with ``skip``, has the ranks agree on a side gloo group: if any rank's batch is bad,
  every rank skips the step (:class:`~trainguard.contract.errors.SkipStep`), so the model is
  never updated from it and the collectives stay matched. The fault travels in the step's
  report; the detector raises ``bad_batch`` and the diagnoser names ``data_pipeline``.

On a GPU the check reads its result on the host, so a checked step waits for the batch's
copy to the device: check the loader's CPU tensors before moving them, or raise ``every``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from trainguard.contract import envnames
from trainguard.contract.errors import ConfigError, SkipStep
from trainguard.contract.evidence import BatchFault
from trainguard.recovery.handle import GuardHandle

log = logging.getLogger("trainguard.torch")

Bounds = Mapping[str, tuple[float, float]]
"""Inclusive ``(low, high)`` by key (``{"input_ids": (0, vocab - 1)}``); ``*``: any key."""


class StepHandle(Protocol):
    """The part of ``guard.step(n)``'s handle a batch check writes."""

    n: int
    batch_fault: BatchFault | None


def check_batch(batch: Any, *, max_abs: float | None = None, bounds: Bounds | None = None,
                reference: dict[str, tuple[torch.dtype, int]] | None = None,
                ids: Sequence[Any] | torch.Tensor | None = None,
                source: str = "") -> BatchFault | None:
    """The first thing wrong with ``batch`` (tensors in mappings, lists and tuples), or None.

    ``max_abs``: the largest magnitude a floating value may have. ``bounds``: per key.
    ``reference``: each key's dtype and number of dimensions, filled from the first batch
    it sees and held against later ones (the batch dimension's size may change: the last
    batch of an epoch is short, a sequence length may vary). ``ids``: the rows' sample
    ids, to name the bad sample; ``source``: where the batch came from.
    """
    if batch is None:
        return BatchFault(kind="none", source=source, detail="the data phase gave None")
    for key, value in _tensors(batch, ""):
        if value is None:
            return BatchFault(kind="empty", key=key, source=source,
                              detail="an empty container")
        fault = _check_tensor(key, value, max_abs, _bound(bounds, key), reference)
        if fault is not None:
            fault.source = source
            if fault.sample is not None and ids is not None:
                fault.sample_id = _sample_id(ids, fault.sample)
            return fault
    return None


def _tensors(obj: Any, key: str) -> list[tuple[str, torch.Tensor | None]]:
    """``(key, tensor)`` for every tensor in ``obj``; ``(key, None)`` for an empty
    container (an empty batch)."""
    if isinstance(obj, torch.Tensor):
        return [(key or "batch", obj)]
    if isinstance(obj, Mapping):
        if not obj:
            return [(key or "batch", None)]
        found: list[tuple[str, torch.Tensor | None]] = []
        for k, v in obj.items():
            found += _tensors(v, f"{key}.{k}" if key else str(k))
        return found
    if isinstance(obj, (list, tuple)):
        if not obj:
            return [(key or "batch", None)]
        found = []
        for i, v in enumerate(obj):
            found += _tensors(v, f"{key}[{i}]")
        return found
    return []  # strings, numbers, metadata: not checked


def _bound(bounds: Bounds | None, key: str) -> tuple[float, float] | None:
    if not bounds:
        return None
    return bounds.get(key, bounds.get("*"))


def _check_tensor(key: str, t: torch.Tensor, max_abs: float | None,
                  bound: tuple[float, float] | None,
                  reference: dict[str, tuple[torch.dtype, int]] | None) -> BatchFault | None:
    if reference is not None:
        seen = reference.setdefault(key, (t.dtype, t.dim()))
        if seen[0] != t.dtype:
            return BatchFault(kind="dtype", key=key, detail=f"{t.dtype}, not {seen[0]}")
        if seen[1] != t.dim():
            return BatchFault(kind="shape", key=key,
                              detail=f"{t.dim()} dimensions {tuple(t.shape)}, not {seen[1]}")
    if t.numel() == 0:
        return BatchFault(kind="empty", key=key, detail=f"shape {tuple(t.shape)}")
    t = t.detach()
    floating = t.is_floating_point() or t.is_complex()
    if floating and not bool(torch.isfinite(t.sum())):
        bad = ~torch.isfinite(t)
        if bool(bad.any()):  # else the sum overflowed: finite values, checked below
            return BatchFault(kind="nonfinite", key=key, sample=_first_row(bad),
                              detail=f"{int(bad.sum())} of {t.numel()} values NaN/Inf")
    if t.is_complex() or t.dtype == torch.bool:
        return None
    limit = bound if bound is not None else \
        ((-max_abs, max_abs) if max_abs is not None and floating else None)
    if limit is None:
        return None
    lo, hi = torch.aminmax(t)
    if float(lo) < limit[0] or float(hi) > limit[1]:
        out = (t < limit[0]) | (t > limit[1])
        return BatchFault(kind="out_of_bounds", key=key, sample=_first_row(out),
                          detail=f"values in [{float(lo):.6g}, {float(hi):.6g}], "
                                 f"outside [{limit[0]:.6g}, {limit[1]:.6g}]")
    return None


def _first_row(mask: torch.Tensor) -> int | None:
    """The first index along the batch dimension where ``mask`` holds."""
    if mask.dim() == 0:
        return None
    rows = mask.reshape(mask.shape[0], -1).any(dim=1).nonzero()
    return int(rows[0, 0]) if rows.numel() else None


def _sample_id(ids: Sequence[Any] | torch.Tensor, row: int) -> str:
    try:
        value = ids[row]
    except (IndexError, KeyError, TypeError):
        return ""
    return str(value.item() if isinstance(value, torch.Tensor) else value)


class BatchCheck:
    """``batch = check(s, next(loader))`` in the data phase of ``with guard.step(n) as s``.

    Args:
        guard: the rank's Guard (only its recovery hook is used: the agreement's side group
            is built again after an in-place re-form).
        every: check every ``every``-th step (0: never); the same steps on every rank.
            Default ``TRAINGUARD_BATCH_CHECK_EVERY`` or 1.
        skip: on a bad batch anywhere, every rank skips the step; False only reports it
            (the values then reach the model). Default ``TRAINGUARD_BAD_BATCH`` (``skip``
            or ``report``) or skip.
        max_abs, bounds: see :func:`check_batch`.
        timeout: of the agreement's collective (a dead peer fails it this soon).

    Construct it at the same point on every rank, after the process group (with ``skip``
    in a distributed job it builds its side group then: a collective).
    """

    def __init__(self, guard: GuardHandle, *, every: int | None = None,
                 skip: bool | None = None, max_abs: float | None = None,
                 bounds: Bounds | None = None, timeout: float = 60.0) -> None:
        env = os.environ
        self.every = every if every is not None else _env_every(env)
        if self.every < 0:
            raise ConfigError(f"every={self.every}: a batch check runs every N >= 1 steps, "
                              "or never with 0")
        self.skip = skip if skip is not None else _env_skip(env)
        self.max_abs = max_abs
        self.bounds = dict(bounds) if bounds else None
        self.reference: dict[str, tuple[torch.dtype, int]] = {}
        self.faults: list[tuple[int, BatchFault]] = []
        """This rank's bad batches (step, fault), newest last (tests, logs)."""
        self.skipped: list[int] = []
        """The steps this rank skipped, its own bad batches and its peers' alike."""
        self._timeout = timeout
        self._agree: Callable[[bool], bool] | None = None
        self._build_agreement()
        recovery = getattr(guard, "recovery", None)
        if recovery is not None:
            recovery.on_regroup(self._build_agreement)

    def _build_agreement(self) -> None:
        """A side gloo group of its own (never the training group's stream), or none."""
        self._agree = None
        if not self.skip or not (dist.is_available() and dist.is_initialized()) \
                or dist.get_world_size() < 2:
            return
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self._timeout))

        def agree(bad: bool) -> bool:
            flag = torch.tensor([1 if bad else 0], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            return bool(flag.item())

        self._agree = agree

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def __call__(self, step: StepHandle, batch: Any, *,
                 ids: Sequence[Any] | torch.Tensor | None = None, source: str = "") -> Any:
        """Return ``batch``; raise ``SkipStep`` when any rank's batch of this step is bad
        (with ``skip``). A fault is attached to ``step`` and goes out with its report."""
        if not self.due(step.n):
            return batch
        fault = check_batch(batch, max_abs=self.max_abs, bounds=self.bounds,
                            reference=self.reference, ids=ids, source=source)
        if fault is not None:
            step.batch_fault = fault
            self.faults.append((step.n, fault))
            log.warning("trainguard: bad batch at step %d (%s%s): %s", step.n, fault.kind,
                        f" in {fault.key}" if fault.key else "", fault.detail)
        if not self.skip:
            return batch
        bad = self._agree(fault is not None) if self._agree is not None else fault is not None
        if bad:
            self.skipped.append(step.n)
            raise SkipStep(f"step {step.n}: a bad batch"
                           + ("" if fault is not None else " on another rank"))
        return batch


def _env_every(env: Mapping[str, str]) -> int:
    raw = env.get(envnames.BATCH_CHECK_EVERY, "").strip()
    if not raw:
        return 1
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{envnames.BATCH_CHECK_EVERY}={raw!r}: set it to a number of "
                          "steps (1: every step, 0: never)") from None


def _env_skip(env: Mapping[str, str]) -> bool:
    raw = env.get(envnames.BAD_BATCH, "").strip().lower() or "skip"
    if raw not in ("skip", "report"):
        raise ConfigError(f"{envnames.BAD_BATCH}={raw!r}: set it to skip (every rank skips "
                          "the step) or report (the batch trains, the fault is reported)")
    return raw == "skip"
