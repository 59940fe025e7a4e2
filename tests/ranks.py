"""Run a function on a few gloo ranks in spawned processes and collect what each sends back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def run_ranks(target: Callable[..., None], world: int, *, timeout: float = 180.0
              ) -> dict[int, Any]:
    """``target(rank, world, port, out)`` on ``world`` processes; each puts ``(rank, value)``
    on ``out``. Returns the values by rank, once every process exited 0."""
    from trainguard.runtime.embedded import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return got
