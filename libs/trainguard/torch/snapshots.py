"""Memory snapshots: a rank's own state in host memory every K steps, the rollback tier
above the disk.

A rollback in place (NaN, silent data corruption) goes back below the failure's onset. The
newest committed checkpoint there lies half a checkpoint interval back on average; a copy of
the state in host memory every K steps lets the ranks go back K steps (plus the steps from
onset to detection) without reading storage. Why it is built the way it is:

* The copy goes into buffers allocated once and reused (pinned where CUDA is in use, so a
  device copy is asynchronous and ordered before the next step's updates by the stream);
  the checksum and a finiteness check run on a background thread, off the training thread.
* Never trusted blindly: a restore recomputes the checksum first and refuses a snapshot
  that does not match, or whose tensors no longer fit the live state (a re-formed mesh);
  the ranks then take the next tier, the committed disk checkpoint, and say why.
* A snapshot whose parameters or optimizer state hold a non-finite value is poisoned:
  never restored, and no later snapshot replaces the clean ones kept until the state is
  restored. A snapshot after the onset of
  a corruption that left the values finite is excluded by the rollback's ``below`` step.
* ``every="auto"``: K is the smallest number of steps whose time covers the snapshot's cost
  ``1/budget`` times over (5% of the step time at most, by default), measured as it runs:
  the copy, and for a state trained on the CPU the background check too.

The ranks agree on which snapshot to restore (:meth:`Checkpointer._on_reload`): the newest
step below the onset that every rank holds and verified.

Once a snapshot's check passed, ``on_checked`` runs on the check thread (the Checkpointer
reports it to the control plane, :class:`~trainguard.contract.schemas.SnapshotReport`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from trainguard.contract.errors import TrainguardError

log = logging.getLogger("trainguard.snapshots")

Every = int | Literal["auto"]


class SnapshotRefused(TrainguardError):
    """A snapshot cannot be restored (missing, failed its check, does not fit the state)."""


@dataclass
class Snapshot:
    """One copy of the rank's state after ``step``."""

    step: int
    names: list[str]
    tensors: list[torch.Tensor]
    values: dict[str, Any]
    """What is not a tensor: optimizer hyperparameters and scalar state, RNG, extra."""
    taken: float
    nbytes: int
    anchor: bool = False
    """Taken at a fingerprinted step: the state a replica mismatch found at the next
    fingerprint goes back to (kept until two newer anchors exist)."""
    check: Future[tuple[int, str]] = field(default_factory=Future)
    """(crc32 over every tensor's bytes, why it is poisoned or "")."""
    copy_seconds: float = 0.0
    """What its copy cost the training thread."""
    check_seconds: float = 0.0
    """Its checksum and finiteness check, in CPU seconds off the training thread."""
    busy: threading.Lock = field(default_factory=threading.Lock)
    """Held while another thread reads the buffers (a buddy copy being sent): a new
    snapshot reusing them waits for it."""
    kept: bool = True
    """Still in the ring (False: its buffers may be overwritten)."""
    origin: str = ""
    """Where it came from when not this rank's own ("rank 3's copy"), for a refusal."""

    def verdict(self, timeout: float | None = None) -> tuple[int, str]:
        return self.check.result(timeout)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view of its storage); any other tensor as it is."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def live_state(model: Any, optimizer: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors a snapshot copies, in a stable order: the model's parameters and
    buffers, then each optimizer state tensor by parameter index and key."""
    for name, p in model.named_parameters():
        yield f"model.{name}", _local(p.data)
    for name, b in model.named_buffers():
        yield f"buffer.{name}", _local(b)
    if optimizer is None:
        return
    for i, p in enumerate(_params(optimizer)):
        for key, v in sorted(optimizer.state.get(p, {}).items()):
            if isinstance(v, torch.Tensor):
                yield f"optim.{i}.{key}", _local(v)


def _params(optimizer: Any) -> list[Any]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _values(optimizer: Any) -> dict[str, Any]:
    """The optimizer's hyperparameters and non-tensor state (a scheduler changes ``lr``),
    and which of its state tensors are DTensors (:meth:`MemorySnapshots.prime`)."""
    if optimizer is None:
        return {}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    state = [(f"optim.{i}.{k}", v) for i, p in enumerate(_params(optimizer))
             for k, v in optimizer.state.get(p, {}).items()]
    scalars = {n: v for n, v in state if not isinstance(v, torch.Tensor)}
    dtensors = [n for n, v in state if isinstance(v, torch.Tensor) and _local(v) is not v]
    return {"groups": groups, "scalars": scalars, "dtensors": dtensors}


def tensor_bytes(t: torch.Tensor) -> Any:
    """A CPU tensor's bytes, as a numpy view (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def pick_victim(ring: list[Snapshot], spacing: float) -> Snapshot:
    """The snapshot a new one replaces in a full ring (oldest first). The two newest
    anchors stay: a mismatch found at the newest fingerprint goes back to the one before,
    and is found only after more snapshots were taken. Of the others, the newest goes while
    it is less than ``spacing`` seconds younger than the one before it (the newest slot
    moves every K steps), else the oldest (the newest stays, as an older one). So the kept
    ones reach back ``(keep - 1) * spacing`` seconds at least, for a rollback whose onset
    was found late."""
    anchors = {id(s) for s in [s for s in ring if s.anchor][-2:]}
    newest = ring[-1]
    if id(newest) not in anchors and (
            len(ring) < 2 or newest.taken - ring[-2].taken < spacing):
        return newest
    return next((s for s in ring if id(s) not in anchors), newest)


class MemorySnapshots:
    """The last ``keep`` snapshots of this rank's state (own memory), every ``every`` steps.

    Args:
        every: steps between snapshots, or ``"auto"`` (from the measured copy cost).
        keep: snapshots kept; host memory is ``keep`` times the rank's state.
        spacing: seconds at least between the kept snapshots older than the newest.
        budget: with ``"auto"``, the share of step time the copy may take.
        rng: returns the RNG states to keep with the state (restored by ``set_rng``).
        position: returns the data stream's position (restored by ``set_position``).
        on_checked: called with each snapshot whose check passed, on the check thread,
            while it is still kept (an exception is logged, never raised).
    """

    def __init__(self, every: Every = "auto", keep: int = 3, *, spacing: float = 10.0,
                 budget: float = 0.05,
                 rng: Callable[[], Any] | None = None,
                 set_rng: Callable[[Any], object] | None = None,
                 position: Callable[[], Any] | None = None,
                 set_position: Callable[[Any], object] | None = None,
                 on_checked: Callable[[Snapshot], object] | None = None) -> None:
        if every != "auto" and (not isinstance(every, int) or every < 1):
            raise ValueError(f"memory snapshots every {every!r} steps: give a whole number "
                             "of steps >= 1, or 'auto'")
        if keep < 1:
            raise ValueError(f"memory snapshots keep={keep}: keep at least 1")
        self.auto = every == "auto"
        self.every = 1 if every == "auto" else int(every)
        self.keep = keep
        self.spacing = spacing
        self.budget = budget
        self._rng, self._set_rng = rng, set_rng
        self._position, self._set_position = position, set_position
        self.on_checked = on_checked
        self.ring: list[Snapshot] = []
        """Oldest first."""
        self.copy_seconds = 0.0
        """The last snapshot's cost on the training thread."""
        self.check_seconds = 0.0
        """The last checked snapshot's checksum and finiteness check, in CPU seconds. A
        state trained on the CPU pays it too (torch's threads use every core); one trained
        on a GPU does not (the host's spare cores run it)."""
        self._on_cpu = True
        self._last_done: float | None = None
        self._step_seconds: float | None = None
        self._next: int | None = None
        self._logged = 0
        self._lock = threading.Lock()
        self._checker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainguard-snap")

    # -- taking ---------------------------------------------------------------------------
    def step_done(self, step: int, model: Any, optimizer: Any,
                  extra: Callable[[], Mapping[str, Any] | None] | None = None, *,
                  anchor: bool = False) -> bool:
        """After ``step`` completed: take a snapshot when one is due, or when ``anchor``
        (the step is fingerprinted: :attr:`Snapshot.anchor`); True if taken. ``extra`` is
        called only then: the steps between cost a clock read."""
        now = time.perf_counter()
        if self._last_done is not None:
            dt = now - self._last_done
            self._step_seconds = dt if self._step_seconds is None \
                else 0.8 * self._step_seconds + 0.2 * dt
        self._last_done = now
        if self._next is not None and step < self._next and not anchor:
            return False
        if self.poisoned():
            return False  # keep the clean ones until the state is restored
        snap = self.take(step, model, optimizer, extra() if extra is not None else None,
                         anchor=anchor)
        self._last_done = time.perf_counter()  # the copy is not step time
        interval = self._interval()
        if not self._logged / 2 < interval < self._logged * 2:  # first, or it moved 2x
            self._logged = interval
            log.info("memory snapshots every %d step(s): %.0f MiB each, %d kept; copy %.1f ms "
                     "on the loop, check %.1f ms off it", interval, snap.nbytes / 2**20,
                     self.keep, 1000 * self.copy_seconds, 1000 * self.check_seconds)
        self._next = step + interval
        return True

    @property
    def interval(self) -> int:
        """Steps between snapshots now."""
        return self._interval()

    def _interval(self) -> int:
        if not self.auto or not self._step_seconds:
            return self.every
        cost = self.copy_seconds + (self.check_seconds if self._on_cpu else 0.0)
        return auto_interval(cost, self._step_seconds, self.budget)

    def poisoned(self) -> bool:
        """Whether the newest snapshot holds a non-finite value (waits for its check)."""
        newest = self.ring[-1] if self.ring else None
        return newest is not None and bool(newest.verdict()[1])

    def take(self, step: int, model: Any, optimizer: Any,
             extra: Mapping[str, Any] | None = None, *, anchor: bool = False) -> Snapshot:
        t0 = time.perf_counter()
        live = list(live_state(model, optimizer))
        reuse = self._reusable(live)
        if reuse is not None:
            reuse.verdict()  # its check must not read what is overwritten now
            with reuse.busy, self._lock:  # nor a buddy copy being sent
                reuse.kept = False
                self.ring.remove(reuse)
            tensors = reuse.tensors
        else:
            pin = torch.cuda.is_available()
            tensors = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
                       for _, t in live]
        for dst, (_, src) in zip(tensors, live, strict=True):
            dst.copy_(src.detach(), non_blocking=src.is_cuda)
        event = None
        self._on_cpu = not any(t.is_cuda for _, t in live)
        if not self._on_cpu:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
        values = {**_values(optimizer), "rng": self._rng() if self._rng else None,
                  "extra": dict(extra) if extra is not None else None,
                  "position": self._position() if self._position else None}
        snap = Snapshot(step=step, names=[n for n, _ in live], tensors=tensors, values=values,
                        taken=time.time(), nbytes=sum(t.numel() * t.element_size()
                                                      for t in tensors), anchor=anchor)
        with self._lock:
            self.ring.append(snap)
        snap.copy_seconds = self.copy_seconds = time.perf_counter() - t0
        self._checker.submit(self._check, snap, event)  # in the ring first: on_checked sees it
        return snap

    def _reusable(self, live: list[tuple[str, torch.Tensor]]) -> Snapshot | None:
        """Once the ring is full, the snapshot the next one replaces (its buffers, where
        they fit): :func:`pick_victim`."""
        if len(self.ring) < self.keep:
            return None
        victim = pick_victim(self.ring, self.spacing)
        fits = victim.names == [n for n, _ in live] and all(
            b.shape == t.shape and b.dtype == t.dtype
            for b, (_, t) in zip(victim.tensors, live, strict=True))
        if not fits:
            with self._lock:
                victim.kept = False
                self.ring.remove(victim)
        return victim if fits else None

    # -- restoring ------------------------------------------------------------------------
    def clean(self) -> list[Snapshot]:
        """The snapshots kept whose check has passed, oldest step first; never waits
        (safe on the check thread, where a check still queued would never end)."""
        return sorted((s for s in list(self.ring)
                       if s.check.done() and not s.check.result()[1]), key=lambda s: s.step)

    def kept(self) -> list[int]:
        """Steps of :meth:`clean`."""
        return [s.step for s in self.clean()]

    def held(self, below: int) -> list[int]:
        """Steps below ``below`` this rank holds clean (checked, finite) snapshots of."""
        return sorted(s.step for s in list(self.ring)
                      if s.step < below and not s.verdict()[1])

    def verify(self, step: int, model: Any, optimizer: Any) -> str:
        """Why snapshot ``step`` must not be restored into this state ("" when it may):
        its checksum recomputed, its tensors against the live ones."""
        snap = self._find(step)
        if snap is None:
            return f"no snapshot of step {step}"
        crc, poisoned = snap.verdict()
        if poisoned:
            return poisoned
        if _crc(snap.tensors) != crc:
            whose = f" ({snap.origin})" if snap.origin else ""
            return f"the snapshot of step {step}{whose} failed its checksum (memory corrupted)"
        live = list(live_state(model, optimizer))
        if [n for n, _ in live] != snap.names:
            return (f"the state's tensors changed since the snapshot of step {step} "
                    "(the optimizer or the model was rebuilt)")
        for (name, t), b in zip(live, snap.tensors, strict=True):
            if t.shape != b.shape or t.dtype != b.dtype:
                return f"{name} is {tuple(t.shape)} now, {tuple(b.shape)} in the snapshot"
        return ""

    def restore(self, step: int, model: Any, optimizer: Any) -> dict[str, Any] | None:
        """Copy snapshot ``step`` back into the live state, in place; returns its
        ``extra``. Raises :class:`SnapshotRefused` when :meth:`verify` does not agree."""
        why = self.verify(step, model, optimizer)
        if why:
            raise SnapshotRefused(why)
        snap = self._find(step)
        assert snap is not None
        with torch.no_grad():
            for (_, t), b in zip(live_state(model, optimizer), snap.tensors, strict=True):
                t.copy_(b, non_blocking=t.is_cuda)
        if optimizer is not None:
            for g, saved in zip(optimizer.param_groups, snap.values["groups"], strict=False):
                g.update(saved)
            for i, p in enumerate(_params(optimizer)):
                for key in list(optimizer.state.get(p, {})):
                    scalar = snap.values["scalars"].get(f"optim.{i}.{key}")
                    if scalar is not None:
                        optimizer.state[p][key] = scalar
        if snap.values["rng"] is not None and self._set_rng is not None:
            self._set_rng(snap.values["rng"])
        if snap.values["position"] is not None and self._set_position is not None:
            self._set_position(snap.values["position"])
        self.restored(step)
        extra: dict[str, Any] | None = snap.values["extra"]
        return extra

    def prime(self, step: int, optimizer: Any) -> None:
        """A fresh optimizer (a replacement's) has no state entries yet: create those
        snapshot ``step`` holds, DTensors placed like their parameters, so that
        :meth:`verify` and :meth:`restore` find the state the snapshot was taken of."""
        snap = self._find(step)
        if snap is None or optimizer is None:
            return
        from trainguard.recovery.sharding import placed_like

        params = _params(optimizer)
        dtensors = set(snap.values.get("dtensors", []))
        for name, t in zip(snap.names, snap.tensors, strict=True):
            if not name.startswith("optim."):
                continue
            _, i, key = name.split(".", 2)
            param = params[int(i)]
            if key not in optimizer.state.get(param, {}):
                fresh = torch.zeros(t.shape, dtype=t.dtype, device=_local(param).device)
                optimizer.state.setdefault(param, {})[key] = \
                    placed_like(fresh, param) if name in dtensors else fresh

    def restored(self, step: int) -> None:
        """The state is now that after ``step`` (from memory or disk): snapshots of later
        steps belong to the abandoned timeline."""
        with self._lock:
            self.ring = [s for s in self.ring if s.step <= step]
        self._next = None
        self._last_done = None

    def adopt(self, snap: Snapshot) -> None:
        """Hold ``snap`` (another rank's, from its buddy: a replacement's state) so that
        :meth:`restore` verifies and restores it; it replaces any of the same step."""
        with self._lock:
            self.ring = sorted([s for s in self.ring if s.step != snap.step] + [snap],
                               key=lambda s: s.step)

    def clear(self) -> None:
        """Forget every snapshot (the group re-formed: shards may have moved)."""
        with self._lock:
            self.ring = []
        self._next = None

    def _find(self, step: int) -> Snapshot | None:
        return next((s for s in reversed(self.ring) if s.step == step), None)

    @property
    def nbytes(self) -> int:
        """Host memory the snapshots hold."""
        return sum(s.nbytes for s in list(self.ring))

    def close(self) -> None:
        self._checker.shutdown(wait=True)
        self.clear()

    def _check(self, snap: Snapshot, event: Any) -> None:
        """Background: the checksum, and whether a parameter or optimizer state holds a
        non-finite value (buffers may by design: a causal mask of -inf)."""
        t0 = time.thread_time()
        try:
            if event is not None:
                event.synchronize()
            # A sum is NaN or infinite when any element is (20x cheaper than isfinite).
            bad = next((n for n, t in zip(snap.names, snap.tensors, strict=True)
                        if not n.startswith("buffer.") and t.is_floating_point()
                        and not math.isfinite(float(t.sum()))), None)
            poisoned = f"the snapshot of step {snap.step} holds non-finite values ({bad})" \
                if bad else ""
            snap.check.set_result((_crc(snap.tensors), poisoned))
        except Exception as exc:  # an unreadable snapshot is one that is never used
            snap.check.set_result((0, f"the snapshot of step {snap.step} could not be "
                                      f"checked: {exc!r}"))
        finally:
            snap.check_seconds = self.check_seconds = time.thread_time() - t0
        if self.on_checked is not None:
            self._checked(snap)

    def _checked(self, snap: Snapshot) -> None:
        """``on_checked(snap)`` for a clean snapshot still kept (one cleared or replaced
        meanwhile is no longer held)."""
        try:
            if snap.verdict()[1] or not any(s is snap for s in list(self.ring)):
                return
            assert self.on_checked is not None
            self.on_checked(snap)
        except Exception:  # reporting must never cost a snapshot
            log.debug("on_checked failed for the snapshot of step %d", snap.step,
                      exc_info=True)


def auto_interval(copy_seconds: float, step_seconds: float, budget: float) -> int:
    """Steps between snapshots so the copy takes at most ``budget`` of the step time."""
    return max(1, math.ceil(copy_seconds / (budget * step_seconds)))


def _crc(tensors: list[torch.Tensor]) -> int:
    crc = 0
    for t in tensors:
        if t.numel():
            crc = zlib.crc32(tensor_bytes(t), crc)
    return crc
