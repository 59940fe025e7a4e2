"""The command agreement: how the ranks of a group settle, at one step, which collective
commands to run, which generation the group is at, and when they agree next.

At each agreement boundary every rank all-reduces (MAX) four integers: the highest
collective-command sequence it received, the newest group generation it knows of, the steps
to the next agreement it proposes, and the negated lowest sequence it holds (:func:`agree`).
Boundaries come about every ``sync_period`` seconds and at most ``sync_every`` steps apart
(:class:`Cadence`): a fixed step count would make a rollback or a save-now wait ten steps of
a slow model (tens of seconds); one all-reduce of four integers per period costs nothing
beside a step. The command desk
(:mod:`trainguard.client.commands`) runs what was agreed; a re-formed group agrees at its
first step. The all-reduce runs on a gloo side group of its own
(:mod:`trainguard.recovery.sidegroup`), loaded only once the trainer runs torch.distributed:
this module imports no torch.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import Final, NamedTuple

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


class Agreed(NamedTuple):
    """What one agreement settled, the same on every rank."""

    seq: int
    """The highest collective-command sequence any rank received."""
    generation: int
    """The newest group generation any rank knows of."""
    interval: int
    """The steps to the next agreement (the slowest rank's proposal)."""
    floor: int
    """The lowest sequence any rank holds (:data:`NONE_HELD` if none): below it, no rank
    will ever get a command, sent before these processes listened."""


def agree(fn: AgreeFn, *, highest_seq: int, generation: int, interval: int,
          lowest_held: int) -> Agreed:
    """One agreement through ``fn`` (a collective: every rank calls it at the same step).
    The MIN of the lowest held sequences travels as the MAX of their negations."""
    seq, gen, steps, neg_floor = fn([highest_seq, generation, interval, -lowest_held])
    return Agreed(seq, gen, steps, -neg_floor)


class Cadence:
    """When a rank's group agrees next: about every ``sync_period`` seconds worth of steps,
    at most ``sync_every`` apart, at a step every rank of the group reaches.

    Each agreement fixes the next boundary from the agreed interval; before the first (and
    after a re-form, which restarts the boundaries from the step the group continues at) a
    boundary is a multiple of :data:`FIRST_EVERY` (or of ``sync_every`` if smaller).
    """

    def __init__(self, sync_every: int = 10, sync_period: float = 0.25,
                 clock: Callable[[], float] | None = None) -> None:
        self.sync_every = max(1, sync_every)
        self.sync_period = sync_period
        self._clock = clock or time.monotonic
        self._next: int | None = None
        """The step the ranks agreed to agree at next; None before the first agreement."""
        self._agreed_at: int | None = None
        """The step of the last agreement."""
        self._step_s: float | None = None
        """This rank's recent step time (moving average), for the next interval."""
        self._mark: float | None = None

    def due(self, completed: int) -> bool:
        """Whether the group agrees after ``completed``."""
        # At or past (a trainer may number its steps with gaps), or back before the last
        # agreement (a rollback in place: the same step on every rank), which would
        # otherwise hold the next one off by all the steps rolled back.
        if self._next is None or self._agreed_at is None:
            return completed % min(self.sync_every, FIRST_EVERY) == 0
        return completed >= self._next or completed < self._agreed_at

    def restart_at(self, completed: int) -> None:
        """A re-formed group agrees at once: its boundaries start again from ``completed``,
        the same step on every rank."""
        self._next = self._agreed_at = completed

    def proposed_interval(self) -> int:
        """The steps to the next agreement this rank proposes: ``sync_period`` worth (the
        next step while no step time is known yet)."""
        if self._step_s is None:
            return 1
        if self._step_s <= 0:
            return self.sync_every
        return max(1, min(self.sync_every, round(self.sync_period / self._step_s)))

    def agreed(self, completed: int, interval: int) -> None:
        """The group agreed after ``completed`` on the steps to the next agreement."""
        self._agreed_at, self._next = completed, completed + max(1, interval)

    def step_done(self, *, timed: bool = True) -> None:
        """A step finished; ``timed=False``: the group went on without running it here (a
        re-form, a rollback), and the time since the last step is no step time."""
        if not timed:
            self._mark = None
            return
        now = self._clock()
        if self._mark is not None:
            dt = now - self._mark
            self._step_s = dt if self._step_s is None else 0.8 * self._step_s + 0.2 * dt
        self._mark = now
