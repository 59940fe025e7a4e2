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
  ``guard.steps``), to its state layout (:func:`.sharding.declaration`); the agent
  replaces a failed rank alone only when every rank of the current group has set it and a
  peer holds the failed rank's state, else it restarts the group.
- :func:`arrivals_key` / :func:`all_here_key`: the ranks of a generation formed in place
  count in before forming it, so a missing one ends their wait at their rejoin deadline
  (or when a host says it left) instead of at the process group's timeout.
- :func:`left_key`: set by an agent whose launcher ends (isolated, held, stopped,
  preempted) to why: its ranks of that generation will not be replaced, so a survivor
  waiting to re-form gives up in place at once and its agent restarts the group at the
  world size that is left, instead of waiting out the rejoin timeout.
- :func:`restart_key`: set by an agent that stops its ranks so that the group restarts
  (a command's group restart, for a rank that cannot be replaced in place) to the
  command's id, *before* it stops them. The other agents' ranks fail on their lost
  peers moments later; their agents read the key and report those exits as the
  command's, so the detector raises no crash of its own for them.
- :func:`resize_key`: written by an agent whose host leaves while the job can go on in
  place without it (:func:`plan_shrink`), *before* it raises the generation: the
  :class:`Resize` of that generation. A survivor that sees the generation rise reads the
  records since its own and forms the new group at their world size and with its new
  rank; its agent adopts them for later replacements. It then stands in for the ``left``
  key. A host taken back in place (:func:`plan_growth`) is a record too: the running ranks
  keep their numbers and the new ones follow them (:data:`JOINS` in ``kept``).

The agents own the generation; the ranks only read it and wait for it to rise.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Final

log = logging.getLogger("trainguard.recovery.groupstore")

GENERATION: Final = "generation"
"""The job's generation counter (``store.add(GENERATION, 0)`` reads it)."""
JOINS: Final = -1
"""In :attr:`Resize.kept`: a new rank, with no rank of the previous generation behind it."""


def job_prefix(run_id: str) -> str:
    """Every trainguard key of one job (``TORCHELASTIC_RUN_ID``) lives under this."""
    return f"trainguard/{run_id}/"


def pg_prefix(generation: int) -> str:
    """The process group of ``generation`` rendezvouses under this prefix."""
    return f"pg/{generation}/"


def in_place_key(generation: int, rank: int) -> str:
    """Set by ``rank`` once it can recover in place in ``generation``, to its state's layout
    (``"1"`` from older ranks: replicated)."""
    return f"in_place/{generation}/{rank}"


def arrivals_key(generation: int) -> str:
    """A counter: the ranks that came to form ``generation`` in place (survivors and the
    replacement; the one that makes it the world size sets :func:`all_here_key`)."""
    return f"arrivals/{generation}"


def all_here_key(generation: int) -> str:
    """Set once every rank of ``generation`` came to form it in place."""
    return f"all_here/{generation}"


def left_key(generation: int) -> str:
    """Set to why by an agent whose ranks of ``generation`` leave the job for good."""
    return f"left/{generation}"


def restart_key(generation: int) -> str:
    """Set to the command id by an agent that stops its ranks of ``generation`` so that
    the group restarts."""
    return f"restart/{generation}"


def resize_key(generation: int) -> str:
    """Set, once, to the :class:`Resize` that ``generation`` was formed with."""
    return f"resize/{generation}"


@dataclass(frozen=True)
class Resize:
    """How one generation's group differs from the previous one's."""

    world_size: int
    """Ranks of the new generation."""
    nodes: int
    """Agents of the new generation (the exit barrier at the job's end counts them)."""
    left: tuple[int, ...]
    """The previous generation's ranks that left."""
    reason: str
    kept: tuple[int, ...] = ()
    """The previous generation's rank of each new rank, in order: the survivors keep their
    order and close up the gap the leaving ranks left (empty: ``0 .. world_size-1``);
    :data:`JOINS` for a rank of a host taken back."""
    node: int = -1
    """The group rank of the node that left (the nodes above it move down one)."""

    def new_rank(self, old: int) -> int | None:
        """The rank ``old`` has in the new generation; None when it left."""
        kept = self.kept or tuple(range(self.world_size))
        try:
            return kept.index(old)
        except ValueError:
            return None

    @property
    def joined(self) -> tuple[int, ...]:
        """The new generation's ranks that join it (a host taken back)."""
        return tuple(r for r, old in enumerate(self.kept) if old == JOINS)

    @property
    def grows(self) -> bool:
        return bool(self.joined)

    def encode(self) -> str:
        return json.dumps({"world_size": self.world_size, "nodes": self.nodes,
                           "left": list(self.left), "reason": self.reason,
                           "kept": list(self.kept), "node": self.node})

    @classmethod
    def decode(cls, raw: bytes | str) -> Resize:
        """Raises ValueError on a record this version cannot read."""
        try:
            d = json.loads(raw)
            resize = cls(int(d["world_size"]), int(d["nodes"]),
                         tuple(int(r) for r in d["left"]), str(d.get("reason", "")),
                         tuple(int(r) for r in d.get("kept", ())), int(d.get("node", -1)))
        except (TypeError, KeyError, ValueError, AttributeError) as exc:
            raise ValueError(f"unreadable resize record {raw!r}: {exc}") from exc
        if resize.kept and len(resize.kept) != resize.world_size:
            raise ValueError(f"unreadable resize record {raw!r}: {len(resize.kept)} kept "
                             f"ranks for world size {resize.world_size}")
        return resize


def plan_shrink(world_size: int, nodes: int, leaving: Collection[int], *,
                min_nodes: int, serves_store: bool, reason: str,
                node: int = -1) -> Resize | str:
    """The group without ``leaving`` (this host's ranks), or why it cannot go on in place.

    The survivors keep their order and are renumbered to close the gap (a survivor below
    the leaving ranks keeps its number). The host that serves the job store cannot leave
    (the survivors re-form on it), nor one whose going takes the job below ``min_nodes``.
    """
    gone = sorted(set(leaving))
    if not gone:
        return "it runs no rank"
    if serves_store:
        return "it serves the job store the survivors re-form on"
    if nodes - 1 < max(1, min_nodes):
        return f"{nodes - 1} node(s) would be left, below --nnodes minimum {min_nodes}"
    outside = [r for r in gone if not 0 <= r < world_size]
    if outside:
        return f"its ranks {outside[:8]} are not in the group of {world_size}"
    kept = tuple(r for r in range(world_size) if r not in set(gone))
    if not kept:
        return "no rank would be left"
    return Resize(world_size=len(kept), nodes=nodes - 1, left=tuple(gone), reason=reason,
                  kept=kept, node=node)


def plan_growth(world_size: int, nodes: int, joining: Collection[tuple[str, int]]
                ) -> Resize:
    """The group with ``joining`` hosts (``(host, nproc)``, in the order their ranks take)
    taken back in place: the running ranks keep their numbers, the new ones follow."""
    added = sum(n for _, n in joining)
    hosts = ", ".join(h for h, _ in joining)
    return Resize(world_size=world_size + added, nodes=nodes + len(joining), left=(),
                  reason=f"host {hosts} rejoined the job",
                  kept=(*range(world_size), *(JOINS,) * added))


def read_resizes(store: Any, after: int, upto: int) -> list[tuple[int, Resize]] | None:
    """The :class:`Resize` records in ``store`` (a ``torch.distributed.Store`` under
    :func:`job_prefix`) of generations ``after+1 .. upto``, oldest first: what a survivor
    or an agent adopts when the generation rose. An unreadable record is skipped with a
    warning; None when the store does not answer (read again later: records are never
    skipped for that)."""
    if upto <= after:
        return []
    if store is None:
        return None
    out: list[tuple[int, Resize]] = []
    try:
        for generation in range(after + 1, upto + 1):
            key = resize_key(generation)
            if store.check([key]):
                try:
                    out.append((generation, Resize.decode(bytes(store.get(key)))))
                except ValueError as exc:
                    log.warning("generation %d: %s", generation, exc)
    except Exception as exc:
        log.debug("resize records unreadable: %r", exc)
        return None
    return out
