"""Agreement on collective commands through a side gloo group.

Ranks all-reduce (MAX) the highest collective-command sequence each has received, and the
newest group generation each knows of, and the steps to their next agreement, at each
agreement boundary (:mod:`trainguard.client.commands`). It runs on a group of
its own so it never interleaves with the training group's collectives, and with a short
timeout so a dead peer fails it quickly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist


def side_group_agreement(timeout: float = 60.0
                         ) -> Callable[[Sequence[int]], list[int]] | None:
    """An ``agree(local values) -> elementwise max over ranks`` function, or None when
    not distributed.

    Must be called at the same point on every rank (``new_group`` is collective).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))

    def agree(local: Sequence[int]) -> list[int]:
        buf = torch.tensor(list(local), dtype=torch.int64)
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
        return [int(v) for v in buf.tolist()]

    return agree
