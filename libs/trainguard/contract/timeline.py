"""A group restart's timeline, from the agent's word of the failure to the first step.

The agent knows when it learned of the failure and what it then did (chose the group
restart, stopped the old ranks, formed the next round with the other agents, started each
rank); the rank knows when it was ready to load, when it had loaded and when its first
step ended. The agent hands its part to each rank it starts in
``TRAINGUARD_RESTART_STAMPS`` (:data:`~trainguard.contract.envnames.RESTART_STAMPS`, JSON of
:class:`RestartStamps`) and the restarted group's rank 0 reports the whole way
back as consecutive phases (:func:`restart_phases`, ``RecoveryReport.phases``). Both
halves are wall-clock instants of one host (the rank's own agent), so no clock is
compared across hosts.
"""

from __future__ import annotations

import math
from typing import Final

import msgspec

RESTART_PHASES: Final = ("decision", "stop", "rendezvous", "spawn", "load", "first_step")
"""The group restart's phases, in order: the agent learned of the failure -> chose the
group restart (``decision``) -> the old ranks on its host were gone (``stop``) -> the
agents formed the next round (``rendezvous``) -> the new rank was ready to load, its
process started (cold or a warm spare), its process group and model built (``spawn``) ->
its checkpoint loaded (``load``) -> its first step ended (``first_step``)."""


class RestartStamps(msgspec.Struct, kw_only=True):
    """The agent's side of one group restart, as wall-clock instants of its host."""

    seen: float
    """It learned of the failure: a local rank's exit, a restart command, another node
    waiting to re-form the group."""
    decided: float
    """It chose the group restart (in place could not take the failure, or was off)."""
    stopped: float
    """Its old ranks were all gone."""
    formed: float
    """The agents' next round formed (the new world size and ranks known)."""
    warm: int = 0
    """Ranks of this host started from warm spares in this restart."""
    ranks: int = 0
    """Ranks this host started in this restart."""


def encode_stamps(stamps: RestartStamps) -> str:
    return msgspec.json.encode(stamps).decode()


def decode_stamps(text: str | None) -> RestartStamps | None:
    """The stamps in ``text`` (None when absent or unreadable: a rank started by another
    launcher, or by an agent of another version, still reports what it knows itself)."""
    if not text:
        return None
    try:
        stamps = msgspec.json.decode(text, type=RestartStamps)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    times = (stamps.seen, stamps.decided, stamps.stopped, stamps.formed)
    return stamps if all(math.isfinite(t) and t > 0 for t in times) else None


def restart_phases(stamps: RestartStamps | None, *, ready: float, loaded: float,
                   first_step: float) -> dict[str, float]:
    """Consecutive seconds of :data:`RESTART_PHASES`, in order; without the agent's stamps
    only the rank's own (``load``, ``first_step``). A phase a clock step would make
    negative counts 0."""
    agent = [("seen", stamps.seen), ("decision", stamps.decided), ("stop", stamps.stopped),
             ("rendezvous", stamps.formed), ("spawn", ready)] if stamps is not None \
        else [("ready", ready)]
    marks = [*agent, ("load", loaded), ("first_step", first_step)]
    return {name: round(max(0.0, t - marks[i - 1][1]), 4)
            for i, (name, t) in enumerate(marks) if i > 0}
