"""Whether a message's body speaks for the sender its subject names.

NATS permissions bind a credential to subjects (a rank's to ``tg.<job>.*.<rank>``), never
to what a body says; a receiver that believed the body's ``job``, ``rank`` or ``host``
would let one rank report in another's name. :func:`check_bound` is the rule every
receiver's decode path applies once, after decoding and before any handler runs.

What a subject binds (:class:`~trainguard.contract.subjects.ParsedSubject`):

* every subject under the prefix: the job;
* per-rank kinds (``hb``, ``step``, ``fp``, ``ckpt``, ``recovery``, ``reg.<rank>``): the rank;
* per-host kinds (``gpu``, ``node``, ``exit``, ``fr``, ``reg.host-<host>``): the host.

A field the body lacks, or a subject outside the prefix, binds nothing.
"""

from __future__ import annotations

from typing import Final

from .errors import InvalidToken, Misaddressed
from .subjects import Subjects

RANK_KINDS: Final = frozenset({"hb", "step", "fp", "ckpt", "recovery", "reg"})
HOST_KINDS: Final = frozenset({"gpu", "node", "exit", "fr", "reg"})


def check_bound(subjects: Subjects, subject: str, body: object) -> None:
    """Raise :class:`Misaddressed` if ``body``'s job, rank or host is not ``subject``'s."""
    try:
        parsed = subjects.parse(subject)
    except InvalidToken:
        return
    kind = parsed.kind
    job = getattr(body, "job", None)
    if isinstance(job, str) and job != parsed.job:
        raise Misaddressed(f"{type(body).__name__} names job {job!r} on {subject} (job "
                           f"{parsed.job!r}): a sender speaks only for its own subject")
    host = parsed.host if kind in HOST_KINDS else None
    if host is not None:
        said = getattr(body, "host", None)
        if isinstance(said, str) and said != host:
            raise Misaddressed(f"{type(body).__name__} names host {said!r} on {subject} "
                               f"(host {host!r}): a sender speaks only for its own subject")
        return
    rank = parsed.rank if kind in RANK_KINDS else None
    said_rank = getattr(body, "rank", None)
    if rank is not None and isinstance(said_rank, int) and said_rank != rank:
        raise Misaddressed(f"{type(body).__name__} names rank {said_rank} on {subject} "
                           f"(rank {rank}): a sender speaks only for its own subject")
