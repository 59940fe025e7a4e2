"""Where a command goes: the one place that knows which kinds travel to a rank and which
to its host's agent (docs/design.md, section 3, "Commands")."""

from __future__ import annotations

import time
from typing import Any

from .envelope import uuid7
from .errors import ConfigError
from .schemas import AGENT_KINDS, Command
from .subjects import Subjects


def for_agent(kind: str) -> bool:
    """Kinds the node agent runs (restart, isolate, dump, kill, freeze, xid, ...)."""
    return kind in AGENT_KINDS


def addressed(subjects: Subjects, job: str, kind: str, params: dict[str, Any] | None = None,
              *, issuer: str, rank: int | None = None, host: str | None = None,
              everyone: bool = False, epoch: int = 0, at_step: int | None = None,
              seq: int = 0, deadline: float | None = None, retry_of: str | None = None,
              ) -> tuple[str, Command]:
    """The subject and the command for ``kind``: the one way a ``Command`` is built.

    ``everyone`` sends it to ``cmd.all`` (every rank and agent of the job, each running the
    kinds that are its own). Otherwise agent kinds go to ``cmd.host.<host>`` (with
    ``params.rank`` when one rank is meant) and rank kinds to ``cmd.rank.<rank>``.
    ``Command.target`` is the subject's tail (``all``, ``host.<h>``, ``rank.<r>``).
    ``deadline`` is seconds from now.
    """
    params = dict(params or {})
    if everyone:
        if rank is not None or host is not None:
            raise ConfigError(f"{kind} to everyone names neither a rank nor a host")
        subject = subjects.cmd_all(job)
    elif for_agent(kind):
        if host is None:
            raise ConfigError(f"{kind} is carried out by the node agent: name its host")
        subject = subjects.cmd_host(job, host)
        if rank is not None:
            params["rank"] = rank
    elif rank is not None:
        subject = subjects.cmd_rank(job, rank)
    else:
        raise ConfigError(f"{kind} is a rank-side command: name the rank")
    now = time.time()
    target = ".".join(subjects.parse(subject).rest)
    return subject, Command(id=uuid7(), job=job, kind=kind, issuer=issuer, epoch=epoch,
                            target=target, params=params, at_step=at_step, seq=seq,
                            issued_at=now, retry_of=retry_of,
                            deadline=now + deadline if deadline is not None else None)
