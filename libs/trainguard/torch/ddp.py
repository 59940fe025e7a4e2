"""DDP instrumentation: collective wait time and issued/completed counts, via a comm hook.

DDP runs its all-reduces inside ``backward()``, so a trainer has no ``comm`` phase to
wrap. The hook performs the same all-reduce as DDP's default (average of gradients) and
records, per step, how long at least one collective was outstanding. That time moves from
the phase it overlapped into ``comm``, so the detector compares compute without the wait
(a straggler's peers wait for it; the straggler itself does not). ``coll_seq`` and
``coll_done`` go into heartbeats: the rank with the fewest issued collectives is the one
a hung job is waiting for.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from trainguard.recovery.ddprebuild import InPlaceDDP

if TYPE_CHECKING:
    from trainguard.recovery.handle import GuardHandle


class CommTimer:
    """Counts collectives into the Guard's shared :class:`~trainguard.core.rankstate.RankState`
    (the heartbeat reads them) and keeps each step's wait per phase."""

    def __init__(self, guard: GuardHandle, process_group: Any = None) -> None:
        self.state = guard.state
        self.group = process_group
        self._lock = threading.Lock()
        self._since = 0.0
        self._phase: str | None = None
        self._waits: dict[str, float] = {}

    def issued(self) -> None:
        g = self.state
        with self._lock:
            g.coll_seq += 1
            if g.comm_outstanding == 0:
                self._since = time.perf_counter()
                self._phase = g.phase
            g.comm_outstanding += 1

    def completed(self) -> None:
        g = self.state
        with self._lock:
            g.coll_done += 1
            g.comm_outstanding -= 1
            if g.comm_outstanding == 0:
                phase = self._phase or "step"
                self._waits[phase] = self._waits.get(phase, 0.0) + \
                    time.perf_counter() - self._since

    def account(self, phases: dict[str, float]) -> None:
        """Called by the Guard at the end of a step: move wait time into ``comm``."""
        with self._lock:
            waits, self._waits = self._waits, {}
        for phase, wait in waits.items():
            if phase in phases:
                phases[phase] = max(0.0, phases[phase] - wait)
            phases["comm"] = phases.get("comm", 0.0) + wait


def _allreduce_hook(state: CommTimer, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    group = state.group if state.group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    tensor = bucket.buffer()
    tensor.div_(world)
    state.issued()
    work: Any = dist.all_reduce(tensor, group=group, async_op=True)
    fut: torch.futures.Future[list[torch.Tensor]] = work.get_future()

    def done(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        state.completed()
        return f.value()[0]

    result: torch.futures.Future[torch.Tensor] = fut.then(done)
    return result


# DDP validates a hook's annotations as objects; this module's are strings (PEP 563).
_allreduce_hook.__annotations__ = {"state": CommTimer, "bucket": dist.GradBucket,  # type: ignore[attr-defined]
                                   "return": torch.futures.Future[torch.Tensor]}


def instrument_ddp(model: Any, guard: GuardHandle, process_group: Any = None) -> CommTimer:
    """Register the timing hook on a ``DistributedDataParallel`` model (before training)."""
    timer = CommTimer(guard, process_group)
    model.register_comm_hook(timer, _allreduce_hook)
    guard.set_phase_accounting(timer.account)
    return timer


def ddp(module: torch.nn.Module, guard: GuardHandle, *, instrument: bool = True,
        **ddp_kwargs: Any) -> InPlaceDDP:
    """Wrap ``module`` in DDP that is rebuilt on the new group after an in-place re-form
    (:class:`~trainguard.recovery.ddprebuild.InPlaceDDP`), its collectives timed by
    :func:`instrument_ddp` unless ``instrument`` is False."""
    return InPlaceDDP(module, guard, instrument=instrument_ddp if instrument else None,
                      **ddp_kwargs)
