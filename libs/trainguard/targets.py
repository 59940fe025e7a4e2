"""Where a command goes: the one place that knows which kinds travel to a rank and which
to its host's agent (DESIGN.md section 12, "Commands")."""

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


def addressed(subjects: Subjects, job: str, kind: str, params: dict[str, Any], *,
              issuer: str, rank: int | None = None, host: str | None = None) -> tuple[str,
                                                                                   Command]:
    """The subject and the command for ``kind`` aimed at ``rank`` or ``host``.

    Agent kinds go to ``cmd.host.<host>`` (with ``params.rank`` when one rank is meant);
    rank kinds to ``cmd.rank.<rank>``.
    """
    params = dict(params)
    if for_agent(kind):
        if host is None:
            raise ConfigError(f"{kind} is carried out by the node agent: name its host")
        subject = subjects.cmd_host(job, host)
        if rank is not None:
            params["rank"] = rank
    elif rank is not None:
        subject = subjects.cmd_rank(job, rank)
    else:
        raise ConfigError(f"{kind} is a rank-side command: name the rank")
    return subject, Command(id=uuid7(), job=job, kind=kind, issuer=issuer, params=params,
                            issued_at=time.time())
