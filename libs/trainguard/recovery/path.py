"""Whether a failed rank is replaced alone, in place, or the group restarts cold.

In-place recovery (docs/design.md, "In-place recovery") keeps the survivors running: they
catch the failing collective, wait for the job's generation to rise and re-form the group
with a replacement that takes its state from them. The agent may only go that way when
every rank of the current generation said it can (``groupstore.in_place_key``, set by
``trainguard.torch`` once ``guard.steps`` runs); a trainer that did not say so would see
its peers' errors and die, so it gets today's group restart from the committed checkpoint.

:func:`decide` is the rule, pure and tested as a table; :func:`missing_keys` reads the
job store (``TCPStore.check``, public torch API) for it. The reason of a "no" is what the
agent reports (a ``RecoveryReport`` with ``path="restart"``), so the incident says why.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from . import groupstore

log = logging.getLogger("trainguard.agent")

NAMED_MAX = 8
"""Ranks named in a reason (a 1000-rank job must not write them all)."""


@dataclass(frozen=True)
class Decision:
    in_place: bool
    reason: str
    """Why not (empty for in place)."""


def _ranks(ranks: Collection[int]) -> str:
    shown = sorted(ranks)[:NAMED_MAX]
    more = len(ranks) - len(shown)
    return ", ".join(map(str, shown)) + (f" and {more} more" if more > 0 else "")


def decide(*, enabled: bool, failed: Sequence[int], initiated: Collection[int],
           restarts_left: int, generation: int | None,
           missing: Collection[int] | None) -> Decision:
    """In place, or why not.

    ``failed``: the ranks that just exited non-zero; ``initiated``: those among them a
    command or the launcher stopped (a group restart under way, never a fault to repair);
    ``generation``: the job's current one (None: the store does not answer); ``missing``:
    the ranks of that generation without their in-place key (None: not read)."""
    if not enabled:
        return Decision(False, "in-place recovery is off for this agent (--no-in-place)")
    if initiated:
        return Decision(False, f"rank(s) {_ranks(initiated)} were stopped by a command")
    if len(failed) != 1:
        return Decision(False, f"{len(failed)} ranks failed at once ({_ranks(failed)}): "
                               "in place replaces one")
    if restarts_left <= 0:
        return Decision(False, "no restarts left (--max-restarts)")
    if generation is None:
        return Decision(False, "the job store does not answer")
    if missing is None:
        return Decision(False, f"the in-place keys of generation {generation} cannot be read")
    if missing:
        return Decision(False, (
            f"rank(s) {_ranks(missing)} did not declare in-place recovery in generation "
            f"{generation} (a trainer without trainguard.torch.init_process_group and "
            "guard.steps, or a group still re-forming after an earlier failure)"))
    return Decision(True, "")


def missing_keys(store: Any, generation: int, world_size: int) -> list[int] | None:
    """The ranks of ``generation`` that have not set their in-place key (None: the store
    did not answer). One ``check`` of every key first: the common case is one round trip."""
    keys = [groupstore.in_place_key(generation, r) for r in range(world_size)]
    try:
        if store.check(keys):
            return []
        return [r for r, k in enumerate(keys) if not store.check([k])]
    except Exception as exc:  # the store host left: no in-place recovery without it
        log.debug("in-place keys unreadable: %r", exc)
        return None
