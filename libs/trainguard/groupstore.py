"""The job store's keys: one vocabulary for the agents and the ranks.

The job's stores outlive every process group of the job: the rendezvous store (the
job-wide generation counter, for the agents) and each round's group store, which the ranks
reach at ``MASTER_ADDR:MASTER_PORT`` (``services/agent/rendezvous.py``). Under
:func:`job_prefix` they hold:

- :data:`GENERATION`, a counter: the job's process-group generation. It rises by one at
  every new group (a rendezvous round) and at every single-rank replacement; a rank joins
  the generation ``TRAINGUARD_GENERATION`` names, or a newer one.
- :func:`pg_prefix`: the store prefix of one generation's process group, so a re-formed
  group never reads the keys of the group it replaces.
- :func:`in_place_key`: set by a rank whose trainer recovers in place (it formed its
  process group through ``trainguard.torch.init_process_group`` and iterates
  ``guard.steps``); the agent replaces a failed rank alone only when every rank of the
  current group has set it, else it restarts the group.
- :func:`left_key`: set by an agent whose launcher ends (isolated, held, stopped,
  preempted) to why: its ranks of that generation will not be replaced, so a survivor
  waiting to re-form gives up in place at once and its agent restarts the group at the
  world size that is left, instead of waiting out the rejoin timeout.

The agents own the generation; the ranks only read it and wait for it to rise.
"""

from __future__ import annotations

from typing import Final

GENERATION: Final = "generation"
"""The job's generation counter (``store.add(GENERATION, 0)`` reads it)."""


def job_prefix(run_id: str) -> str:
    """Every trainguard key of one job (``TORCHELASTIC_RUN_ID``) lives under this."""
    return f"trainguard/{run_id}/"


def pg_prefix(generation: int) -> str:
    """The process group of ``generation`` rendezvouses under this prefix."""
    return f"pg/{generation}/"


def in_place_key(generation: int, rank: int) -> str:
    """Set (to ``"1"``) by ``rank`` once it can recover in place in ``generation``."""
    return f"in_place/{generation}/{rank}"


def left_key(generation: int) -> str:
    """Set to why by an agent whose ranks of ``generation`` leave the job for good."""
    return f"left/{generation}"
