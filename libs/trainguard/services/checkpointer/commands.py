"""Collective commands the coordinator sends to ranks: ``save_now`` and ``set_interval``.

Both must run at the same step on every rank (docs/design.md, section 3, "Commands"). With
fresh detector progress the command carries ``at_step`` = newest step + a margin that
covers delivery (a rank that is already past it answers ``too_late`` and the sender retries
later).
Without progress it carries a ``seq`` from the job's shared counter instead, and the ranks
agree on it through their side-group all-reduce at the next ``sync_every`` boundary.
"""

from __future__ import annotations

import math
from typing import Any

from trainguard.contract.schemas import Command
from trainguard.contract.targets import addressed
from trainguard.runtime.state import Progress

from .catalogue import Catalogue
from .settings import CheckpointerSettings

ISSUER = "coordinator"


def margin_steps(progress: Progress, settings: CheckpointerSettings) -> int:
    """Steps ahead of the newest one: enough for ``save_margin_seconds`` of delivery."""
    steps = settings.save_margin_steps
    st = progress.median_step_time
    if st and st > 0 and math.isfinite(st):
        steps = max(steps, math.ceil(settings.save_margin_seconds / st))
    return max(1, steps)


class CommandFactory:
    def __init__(self, catalogue: Catalogue, settings: CheckpointerSettings) -> None:
        self.catalogue = catalogue
        self.settings = settings

    async def progress(self, job: str) -> Progress | None:
        return await self.catalogue.progress(job, self.settings.progress_max_age)

    async def build(self, job: str, kind: str, params: dict[str, Any], *,
                    after_step: int | None = None, retry_of: str | None = None,
                    deadline: float | None = None) -> Command:
        """A collective command: ``at_step`` past both the detector's newest step and
        ``after_step`` (a step a rank said it had done), else a ``seq``.

        For ``set_interval`` with an ``at_step``, ``from_step`` is the step after it, so
        every rank counts the new interval from the same place.
        """
        progress = await self.progress(job)
        epoch = await self.catalogue.epoch()
        params = dict(params)
        newest = max((s for s in (progress.last_step if progress else None, after_step)
                      if s is not None), default=None)
        at_step: int | None = None
        seq = 0
        if newest is not None:
            margin = margin_steps(progress, self.settings) if progress \
                else self.settings.save_margin_steps
            at_step = newest + margin
            if kind == "set_interval":
                params.setdefault("from_step", at_step + 1)
        else:
            seq = await self.catalogue.next_seq(job)
        _, cmd = addressed(self.settings.subjects, job, kind, params, issuer=ISSUER,
                           everyone=True, epoch=epoch, at_step=at_step, seq=seq,
                           deadline=deadline, retry_of=retry_of)
        return cmd
