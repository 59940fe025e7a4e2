"""Whether a failed rank is replaced alone, in place, or the group restarts cold.

In-place recovery (docs/design.md, "In-place recovery") keeps the survivors running: they
catch the failing collective, wait for the job's generation to rise and re-form the group
with a replacement that takes its state from them. The agent may only go that way when
every rank of the current generation said it can (``groupstore.in_place_key``, set by
``trainguard.torch`` once ``guard.steps`` runs); a trainer that did not say so would see
its peers' errors and die, so it gets today's group restart from the committed checkpoint.
The key's value says how the rank's state is laid out (:mod:`.sharding`): a replacement
takes its state from a peer that holds the same, which a replicated state always has and
a hybrid one (HSDP) has in the lost shard's replicas, where every rank can build its
sharded model again on the re-formed group; otherwise the agent chooses the group restart
at once instead of waiting for a transfer that cannot come.

:func:`decide` is the rule, pure and tested as a table; :func:`read_keys` reads the
job store (``TCPStore.check``, public torch API) for it. The reason of a "no" is what the
agent reports (a ``RecoveryReport`` with ``path="restart"``), so the incident says why.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from . import groupstore
from .sharding import Declared, holders, read_declaration

log = logging.getLogger("trainguard.agent")

NAMED_MAX = 8
"""Ranks named in a reason (a 1000-rank job must not write them all)."""


@dataclass(frozen=True)
class InPlaceKeys:
    """The in-place keys of one generation, as :func:`read_keys` found them."""

    missing: list[int]
    """Ranks that have not set theirs."""
    declared: dict[int, Declared]
    """What the others said of their state (read only once every rank declared)."""


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
           keys: InPlaceKeys | None) -> Decision:
    """In place, or why not.

    ``failed``: the ranks that just exited non-zero; ``initiated``: those among them a
    command or the launcher stopped (a group restart under way, never a fault to repair);
    ``generation``: the job's current one (None: the store does not answer); ``keys``:
    that generation's in-place keys (None: not read)."""
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
    if keys is None:
        return Decision(False, f"the in-place keys of generation {generation} cannot be read")
    if keys.missing:
        return Decision(False, (
            f"rank(s) {_ranks(keys.missing)} did not declare in-place recovery in generation "
            f"{generation} (a trainer without trainguard.torch.init_process_group and "
            "guard.steps, or a group still re-forming after an earlier failure)"))
    lost = failed[0]
    state = keys.declared.get(lost)
    if state is not None and state.kind != "replicated":
        others = holders(keys.declared, lost)
        if not others and not state.kept:
            return Decision(False, (
                f"no other rank holds rank {lost}'s state ({state.kind}, shard {state.group}):"
                " a replacement cannot get it from a peer, so the group restarts from the "
                "committed checkpoint at once"))
        unbuilt = sorted(r for r, d in keys.declared.items() if not (d.rebuilds or d.kept))
        if unbuilt:
            held = f"also held by rank(s) {_ranks(others)}" if others else \
                "kept in memory on another host"
            return Decision(False, (
                f"rank {lost}'s state is {state.kind} (shard {state.group}, {held}), but "
                f"rank(s) {_ranks(unbuilt)} cannot rebuild their sharded model on a "
                "re-formed group (build it with trainguard.torch.fsdp), so the group "
                "restarts from the committed checkpoint"))
    return Decision(True, "")


def read_keys(store: Any, generation: int, world_size: int) -> InPlaceKeys | None:
    """The in-place keys of ``generation`` (None: the store did not answer). One ``check``
    of every key first: the common case is two round trips."""
    keys = [groupstore.in_place_key(generation, r) for r in range(world_size)]
    try:
        if not store.check(keys):
            return InPlaceKeys([r for r, k in enumerate(keys) if not store.check([k])], {})
        values = store.multi_get(keys)
    except Exception as exc:  # the store host left: no in-place recovery without it
        log.debug("in-place keys unreadable: %r", exc)
        return None
    return InPlaceKeys([], {r: read_declaration(bytes(v)) for r, v in enumerate(values)})


def resize_blocker(keys: InPlaceKeys | None, leaving: Collection[int] = ()) -> str | None:
    """Why the group cannot shrink or grow in place, given :func:`read_keys`' answer (None:
    it can), ``leaving``: the ranks that go. Every rank must have declared. Replicated
    state goes on as it is. A hybrid state (HSDP) goes on when every rank rebuilds its
    model on the new group and every shard keeps a holder: the survivors re-mesh, a rank
    whose shard moved (and a host taken back) takes it from a holder, as a replacement
    does; so does an HSDP state down to one replica (declared ``sharded``) when it grows
    again. A sharded state otherwise (FSDP over the world) loses its shards with the host,
    and growing it would reshard every parameter: the group restarts and the checkpoint
    reshards."""
    if keys is None:
        return "the in-place keys cannot be read"
    if keys.missing:
        return f"rank(s) {_ranks(keys.missing)} did not declare in-place recovery"
    declared = keys.declared
    fixed = sorted(r for r, d in declared.items() if d.kind != "replicated" and not d.rebuilds)
    if any(declared[r].kind == "sharded" for r in fixed):
        return ("the job's state is sharded with no replica: a resize in place would "
                "reshard every parameter, so the group restarts and the checkpoint reshards")
    if fixed:
        return (f"rank(s) {_ranks(fixed)} cannot rebuild their sharded model on a new group "
                "(build it with trainguard.torch.fsdp)")
    if all(d.kind == "replicated" for d in declared.values()):
        return None
    gone = set(leaving)
    lost = sorted({d.group for r, d in declared.items()
                   if all(q in gone for q, e in declared.items() if e.group == d.group)})
    if lost:
        return f"no rank that stays holds the shard(s) {', '.join(lost)}"
    return None
