"""The remediator's calls to the checkpoint coordinator (:mod:`trainguard.contract.rpc`).

A call that gets no answer (no coordinator, a timeout, a lost connection) or an unreadable
one is not an error here: it becomes the step's outcome (:func:`.engine.save_outcome`,
:func:`.engine.rollback_outcome`), worded for the incident.
"""

from __future__ import annotations

import nats.errors

from trainguard.contract.errors import DecodeError
from trainguard.contract.rpc import (
    RESUME,
    ROLLBACK,
    SAVE,
    Endpoint,
    Rep,
    Req,
    Requester,
    ResumeRequest,
    RollbackReply,
    RollbackRequest,
    SaveRequest,
    call,
)
from trainguard.contract.subjects import Subjects

from .engine import Outcome, rollback_outcome, save_outcome


class Coordinator:
    def __init__(self, nc: Requester, subjects: Subjects) -> None:
        self.nc = nc
        self.subjects = subjects

    async def save(self, job: str, deadline: float) -> Outcome:
        """Save now, waiting up to ``deadline`` seconds for the commit."""
        return save_outcome(*await self._call(job, SAVE, SaveRequest(deadline=deadline),
                                              deadline + 5))

    async def rollback_to(self, job: str, below_step: int
                          ) -> tuple[RollbackReply | None, Outcome]:
        """Point the job's resume pointer below ``below_step``; the reply says where it went
        (a ``reload`` in place names that step and path, a restart resumes there)."""
        reply, error = await self._call(job, ROLLBACK, RollbackRequest(below_step=below_step),
                                        10.0)
        return reply, rollback_outcome(reply, error)

    async def resume_step(self, job: str) -> int:
        """Where training resumed: the resume pointer; without one (or without an answer),
        from the start."""
        point, _ = await self._call(job, RESUME, ResumeRequest(requester="remediator"), 2.0)
        return point.step if point is not None else 0

    async def _call(self, job: str, endpoint: Endpoint[Req, Rep], req: Req,
                    timeout: float) -> tuple[Rep | None, str]:
        """The reply (None when empty), or None and why there is none."""
        try:
            return await call(self.nc, self.subjects, job, endpoint, req, timeout), ""
        except DecodeError as exc:
            return None, f"unreadable reply from the checkpoint coordinator ({exc.reason})"
        except (nats.errors.Error, OSError) as exc:  # no responders, timeout, disconnected
            return None, f"no answer from the checkpoint coordinator ({exc!r})"
