"""The command agreement: how the ranks of a group settle, at one step, which collective
commands to run, which generation the group is at, and when they agree next.

At each agreement boundary every rank all-reduces (MAX) four integers: the highest
collective-command sequence it received, the newest group generation it knows of, the steps
to the next agreement it proposes, and the negated lowest sequence it holds. The command desk
(:mod:`trainguard.client.commands`) runs what was agreed; a re-formed group agrees at its
first step. The all-reduce runs on a gloo side group of its own
(:mod:`trainguard.recovery.sidegroup`), loaded only once the trainer runs torch.distributed:
this module imports no torch.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import Final

log = logging.getLogger("trainguard.client")

AgreeFn = Callable[[Sequence[int]], list[int]]
"""Elementwise all-reduce (MAX) of ints across ranks; installed when torch.distributed is
running."""

NONE_HELD: Final = 2**62
"""The lowest held sequence a rank that holds none proposes (the agreement takes the MIN of
the lowest held, as the MAX of their negations)."""

FIRST_EVERY: Final = 10
"""The first agreement comes at a multiple of this (ranks start at one step, any step: a
job resumed at step 1337 with ``sync_every=1000`` must not wait for step 2000)."""


def find_agreement(world_size: int) -> AgreeFn | None:
    """The all-reduce ranks agree through, once torch.distributed runs; else None.

    Only looked for if the trainer imported torch.distributed: the client never imports
    torch by itself.
    """
    if world_size < 2 or "torch.distributed" not in sys.modules:
        return None
    try:
        from .sidegroup import side_group_agreement

        return side_group_agreement()
    except Exception:
        log.debug("no collective agreement", exc_info=True)
        return None
