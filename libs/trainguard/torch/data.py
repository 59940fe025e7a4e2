"""``trainguard.torch.Batches``: the data stream a step reads, where the step says it is.

A resumed job that restores the model but not the data stream repeats or skips samples,
silently. So the stream's position goes wherever the state goes:

* into every checkpoint and memory snapshot (the :class:`~.checkpoint.Checkpointer` given
  ``data=``), restored with them;
* across an in-place recovery: a survivor goes back to its own position before the step it
  abandoned (its loader had already yielded that step's batch), a replacement takes the
  source's (a data-parallel stream's position is how far it got, the same on every rank;
  each rank's sampler knows its own share).

A position is the epoch, the batches yielded in it, and the loader's own ``state_dict()``
when it has one (torchdata's ``StatefulDataLoader``, or any loader with
``state_dict``/``load_state_dict``): restoring a position makes a new iterator, so the
next batch is the one after it. A loader without state is fast-forwarded instead (its
skipped batches are read again: correct, but slow for a long epoch). The sampler's
``set_epoch`` is called at each epoch, so a shuffled stream reshuffles the same way after
a resume.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from trainguard.recovery.handle import GuardHandle

from .batches import BatchCheck, StepHandle
from .trusted import from_blob, to_blob

log = logging.getLogger("trainguard.torch")

KEPT = 2
"""Positions kept by step: the step being run and the one before (an abandoned step)."""


class Loader(Protocol):
    def __iter__(self) -> Iterator[Any]: ...


class Batches:
    """``batch = batches.next(s)`` in the data phase of ``with guard.step(n) as s``.

    Args:
        loader: any iterable of batches; with ``state_dict``/``load_state_dict`` its own
            state travels (exact and cheap to restore).
        guard: the rank's Guard (in-place recovery rewinds the stream).
        check: a :class:`~.batches.BatchCheck` run on each batch (skips a bad one).

    Construct it at the same point on every rank (a replacement's joins the position
    hand-over its peers run).
    """

    def __init__(self, loader: Iterable[Any], guard: GuardHandle | None = None, *,
                 check: BatchCheck | None = None) -> None:
        self.loader = loader
        self.check = check
        self.epoch = 0
        self.yielded = 0
        """Batches yielded in this epoch."""
        self.stateful = callable(getattr(loader, "state_dict", None)) and \
            callable(getattr(loader, "load_state_dict", None))
        self._it: Iterator[Any] | None = None
        self._skip = 0  # batches a stateless loader must pass over after a restore
        self._restored: dict[str, Any] | None = None
        """The position restored, until its iterator starts: a StatefulDataLoader asked
        for its state before then forgets the state it was given."""
        self._before: dict[int, dict[str, Any]] = {}
        self._last: int | None = None
        recovery = getattr(guard, "recovery", None) if guard is not None else None
        on_stream = getattr(recovery, "on_stream", None)
        self.rewinds = callable(on_stream)
        """Positions are kept by step only where an in-place recovery may rewind them (a
        ``state_dict()`` a step: ~55 µs for a StatefulDataLoader)."""
        if callable(on_stream):
            on_stream(self)

    # -- reading --------------------------------------------------------------------------
    def next(self, step: StepHandle | int) -> Any:
        """The next batch of the stream, for ``step``: its position before the batch is
        kept (an abandoned step reads the same batch again), and ``check`` runs on it."""
        n = step if isinstance(step, int) else step.n
        if self.rewinds:
            self._before[n] = self.position()
            for old in [k for k in self._before if k < n - KEPT + 1 or k > n]:
                del self._before[old]
        self._last = n
        batch = self._next()
        if self.check is not None and not isinstance(step, int):
            batch = self.check(step, batch)
        return batch

    def _next(self) -> Any:
        for _ in range(2):  # a new epoch once; an empty loader must not loop for ever
            if self._it is None:
                self._start_epoch()
            assert self._it is not None
            try:
                while self._skip:
                    next(self._it)
                    self._skip -= 1
                batch = next(self._it)
            except StopIteration:
                self.epoch += 1
                self.yielded = 0
                self._skip = 0
                self._it = None
                continue
            self.yielded += 1
            return batch
        raise RuntimeError("the data loader yields no batch")

    def _start_epoch(self) -> None:
        for holder in (self.loader, getattr(self.loader, "sampler", None),
                       getattr(self.loader, "batch_sampler", None)):
            set_epoch = getattr(holder, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(self.epoch)
                break
        self._it = iter(self.loader)
        self._restored = None

    # -- positions ------------------------------------------------------------------------
    def position(self) -> dict[str, Any]:
        """Where the stream is now (before the next batch): plain data and tensors."""
        if self._restored is not None:
            return self._restored
        state = self.loader.state_dict() if self.stateful else None  # type: ignore[attr-defined]
        return {"epoch": self.epoch, "yielded": self.yielded, "loader": state}

    def restore(self, position: dict[str, Any]) -> None:
        """Continue from ``position``: the next batch is the one after it."""
        self.epoch = int(position["epoch"])
        self.yielded = int(position["yielded"])
        self._it = None
        self._before.clear()
        self._last = None
        self._restored = position
        if self.stateful and position.get("loader") is not None:
            self.loader.load_state_dict(position["loader"])  # type: ignore[attr-defined]
            self._skip = 0
        else:
            self._skip = self.yielded  # passed over when the epoch's iterator starts
            if self._skip:
                log.warning("trainguard: the data loader has no state_dict: %d batches of "
                            "epoch %d are read again to reach the position", self._skip,
                            self.epoch)

    def encoded(self) -> bytes:
        return to_blob(self.position())

    def restore_encoded(self, blob: bytes) -> None:
        self.restore(from_blob(blob))

    # -- in-place recovery ----------------------------------------------------------------
    def position_before(self, step: int) -> bytes | None:
        """This rank's position before ``step``'s batch, encoded; None if it does not know
        it (a replacement that has read nothing yet)."""
        if step in self._before:
            return to_blob(self._before[step])
        if self._last is not None and step == self._last + 1:
            return self.encoded()
        return None

    def rewind(self, step: int, shared: bytes | None) -> None:
        """The group goes on at ``step``: back to this rank's own position before it, else
        to ``shared`` (the source's)."""
        if self._last is not None and step == self._last + 1:
            return  # already there
        if step in self._before:
            self.restore(self._before[step])
        elif shared is not None:
            self.restore_encoded(shared)
