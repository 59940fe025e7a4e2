"""A DDP model that survives an in-place re-form (``trainguard.torch.ddp(module, guard)``).

A ``DistributedDataParallel`` is bound to the process group it was built on; after the
group re-forms in place it must be built again, and its construction is a collective that
broadcasts rank 0's parameters, so it runs after the state agreement on every rank (on a
replacement rank its first build waits for that agreement). The trainer keeps one object
to call: :class:`InPlaceDDP` holds the user's module as ``module`` (the state-dict keys are
DDP's own) and forwards to the current DDP.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

from torch import nn

from .handle import GuardHandle

Instrument = Callable[[nn.parallel.DistributedDataParallel, GuardHandle], object]
"""What is done to each DDP as it is built (the torch helpers time its collectives)."""


class InPlaceDDP(nn.Module):
    """The user's module under a ``DistributedDataParallel`` that is rebuilt on re-forms.

    Args:
        module: the model to replicate.
        guard: the rank's Guard (with ``trainguard.torch.init_process_group`` installed).
        instrument: called on each new DDP (``trainguard.torch.ddp`` passes its collective
            timing hook, ``instrument_ddp``, re-registered each build); None for none.
        ddp_kwargs: passed to ``DistributedDataParallel`` (``device_ids``, ...).
    """

    def __init__(self, module: nn.Module, guard: GuardHandle, *,
                 instrument: Instrument | None = None, **ddp_kwargs: Any) -> None:
        super().__init__()
        self.module = module
        self._guard = guard
        self._instrument = instrument
        self._kwargs = ddp_kwargs
        self._current: list[nn.parallel.DistributedDataParallel] = []
        """The DDP of the current group, in a list: kept out of the module tree (and so out
        of ``parameters()`` and ``state_dict()``, which stay the module's)."""
        self.builds = 0
        if guard.recovery is not None:
            guard.recovery.on_teardown(self.release)
            guard.recovery.on_regroup(self.rebuild, after_sync=True)
        guard.on_close(self._free)
        if not guard.joining:
            self.rebuild()

    @property
    def ddp(self) -> nn.parallel.DistributedDataParallel:
        if not self._current:
            raise RuntimeError("DDP is not built yet: a replacement rank builds it at the "
                               "first iteration of guard.steps()")
        return self._current[0]

    def release(self) -> None:
        """Drop the DDP of the group being torn down. Its reducer holds that group (and
        hooks the parameters' gradients) until freed; it sits in old reference cycles, so
        the re-form's full ``gc.collect`` (``InPlace.collect_waiting``) is what frees it and
        closes the group's sockets."""
        self._current.clear()

    def _free(self) -> None:
        """At ``guard.close()``, the end of training: free the DDP while its group is still
        up. Left in its reference cycles it would be destroyed at the interpreter's exit,
        after ``destroy_process_group``, where its reducer's teardown can abort the process
        (``terminate called without an active exception``, exit -6, seen on a loaded
        machine after every rank had finished)."""
        self.release()
        gc.collect()

    def rebuild(self) -> None:
        """Build DDP on the current default group (collective)."""
        self.release()
        gc.collect()  # not at a later backward on a dead group
        ddp = nn.parallel.DistributedDataParallel(self.module, **self._kwargs)
        if self._instrument is not None:
            self._instrument(ddp, self._guard)
        self._current[:] = [ddp]
        self.builds += 1

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.ddp(*args, **kwargs)

    def no_sync(self) -> Any:
        """DDP's ``no_sync()`` context (gradient accumulation)."""
        return self.ddp.no_sync()

    def train(self, mode: bool = True) -> InPlaceDDP:
        super().train(mode)
        for ddp in self._current:
            ddp.train(mode)  # type: ignore[no-untyped-call]
        return self

