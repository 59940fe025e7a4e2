"""Ranks that make a collective save impossible: known dead or frozen.

A save-now needs every rank of the job at one step. When the detector already says a
rank's process is gone or stopped (SIGSTOP, a GPU that fell off the bus), waiting out the
deadline only delays what must follow (isolate, restart), so the coordinator gives up at
once and says which ranks and why.
"""

from __future__ import annotations

from trainguard.runtime.state import Progress

BLOCKING_STATES = frozenset({"exited", "stopped", "hung"})
"""Progress states of a rank that will not reach the save's step."""


def blocking_ranks(progress: Progress | None, reported: set[int]) -> dict[int, str]:
    """Ranks of the job's current world that cannot take part in a save, with their state.

    Ranks at or above the world size (left in a shrink) and ranks whose shard is already
    reported do not count.
    """
    if progress is None:
        return {}
    world = progress.world_size
    return {r: p.state for r, p in sorted(progress.ranks.items())
            if p.state in BLOCKING_STATES and (world <= 0 or r < world) and r not in reported}


def describe(blockers: dict[int, str]) -> str:
    return ", ".join(f"rank {r} {state}" for r, state in blockers.items())
