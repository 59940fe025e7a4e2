"""The coordinator's Redis keys, under the deployment prefix.

Per job (``<p>:ckpt:<job>:...``):

==================  ======  ===========================================================
``rec:<step>``      hash    one checkpoint: status, round, id, path, world size, the
                            reports by rank (``r:<rank>``, ``i:<rank>``), verdict fields
``steps``           zset    the steps that have a record (score = step)
``pointer``         string  the resume point: ResumePoint JSON, as ``LATEST`` holds it
``pin``             string  the step a rollback pinned (kept by retention)
``rollback``        string  JSON ``{"below", "at"}`` of the last rollback
``onsets``          hash    open numeric/SDC onsets: anomaly id -> JSON
                            ``{"kind", "step", "at"}``
``handled``         set     anomaly ids a rollback dealt with (not reopened)
``failures``        set     ids of crash/hang anomalies (MTBF)
``incidents``       set     ids of incidents (MTBF)
``since``           string  when the coordinator first saw the job (MTBF window)
``interval``        string  JSON of the interval last published
``memory``          hash    each rank's newest memory snapshot report: rank -> JSON
                            ``{"at", "report"}`` (:mod:`.memory`); expires ``memory_ttl``
                            seconds after the last write
==================  ======  ===========================================================

Global: ``<p>:ckpt:deadlines`` (zset ``<job>/<step>`` -> commit deadline) and
``<p>:ckpt:outbox`` (set of ``<job>/<step>`` whose event still has to go out).
The scripts touch several of these at once, so the layout assumes one Redis primary
(with replicas), not Redis Cluster.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CkptKeys:
    prefix: str = "tg"

    def base(self, job: str) -> str:
        return f"{self.prefix}:ckpt:{job}"

    def rec(self, job: str, step: int) -> str:
        return f"{self.base(job)}:rec:{step}"

    def steps(self, job: str) -> str:
        return f"{self.base(job)}:steps"

    def pointer(self, job: str) -> str:
        return f"{self.base(job)}:pointer"

    def pin(self, job: str) -> str:
        return f"{self.base(job)}:pin"

    def onsets(self, job: str) -> str:
        return f"{self.base(job)}:onsets"

    def failures(self, job: str) -> str:
        return f"{self.base(job)}:failures"

    def incidents(self, job: str) -> str:
        return f"{self.base(job)}:incidents"

    def since(self, job: str) -> str:
        return f"{self.base(job)}:since"

    def interval(self, job: str) -> str:
        return f"{self.base(job)}:interval"

    def memory(self, job: str) -> str:
        return f"{self.base(job)}:memory"

    def deadlines(self) -> str:
        return f"{self.prefix}:ckpt:deadlines"

    def outbox(self) -> str:
        return f"{self.prefix}:ckpt:outbox"


def member(job: str, step: int) -> str:
    """``<job>/<step>``: jobs are subject tokens, so they never contain a slash."""
    return f"{job}/{step}"


def parse_member(value: str) -> tuple[str, int] | None:
    job, _, step = value.rpartition("/")
    return (job, int(step)) if job and step.isdigit() else None
