"""GPU health from the agent's samples: fatal XIDs and rising uncorrectable ECC counts.

A GPU that logs a fatal XID (NVIDIA says it needs a reset or a reboot: XID 79, fallen off
the bus; 48, double-bit ECC; see :mod:`trainguard.runtime.xids`) is lost to the job, often before
any rank has noticed; alerting on the sample lets the diagnoser and the remediator start
(save-now, isolate) while the ranks are still alive. ECC counters are judged by their
*rise* between samples: a non-zero aggregate count is history, a count that grows is a GPU
failing now.
"""

from __future__ import annotations

import dataclasses

from trainguard.contract.evidence import EccRise, GpuHealthEvidence, GpuIdentity, XidSeen
from trainguard.contract.schemas import GpuSample, GpuStats

from .job import JobState

MAX_SEEN_XIDS = 1024


def gpu_key(host: str, gpu: int) -> str:
    return f"gpu:{host}:{gpu}"


@dataclasses.dataclass(slots=True)
class _Finding:
    """What one sample says is wrong with one GPU."""

    xids: list[XidSeen] = dataclasses.field(default_factory=list)
    volatile: EccRise | None = None
    aggregate: EccRise | None = None


class GpuHealth:
    """Fatal XIDs and ECC growth per (host, GPU) of one job."""

    def __init__(self, job: JobState) -> None:
        self.fatal = job.th.xid_set()
        self.ecc: dict[tuple[str, int, str], int] = {}
        self.seen: set[tuple[str, int, int, float]] = set()
        self.last_bad: dict[str, float] = {}

    def _rise(self, host: str, g: GpuStats, counter: str, value: int | None) -> EccRise | None:
        """The counter's rise since the last sample of this GPU, if it rose."""
        if value is None:
            return None
        previous = self.ecc.get((host, g.index, counter))
        self.ecc[(host, g.index, counter)] = value
        if previous is None or value <= previous:
            return None
        return EccRise(from_=previous, to=value)

    def on_sample(self, job: JobState, sample: GpuSample, now: float) -> None:
        host = sample.host
        findings: dict[int, _Finding] = {}
        for x in sample.xids:
            ident = (host, x.gpu, x.code, x.time)
            if x.code not in self.fatal or ident in self.seen:
                continue
            if len(self.seen) >= MAX_SEEN_XIDS:
                self.seen.clear()
            self.seen.add(ident)
            findings.setdefault(x.gpu, _Finding()).xids.append(
                XidSeen(code=x.code, time=x.time, detail=x.detail))
        for g in sample.gpus:
            volatile = self._rise(host, g, "volatile", g.ecc_uncorrected_volatile)
            aggregate = self._rise(host, g, "aggregate", g.ecc_uncorrected_aggregate)
            if volatile is not None or aggregate is not None:
                found = findings.setdefault(g.index, _Finding())
                found.volatile, found.aggregate = volatile, aggregate
        by_index = {g.index: g for g in sample.gpus}
        for index, found in findings.items():
            stats = by_index.get(index)
            identity = None if stats is None else GpuIdentity(
                uuid=stats.uuid, name=stats.name, temperature_c=stats.temperature_c,
                remapped_rows_pending=stats.remapped_rows_pending,
                retired_pages_pending=stats.retired_pages_pending)
            ranks = self._ranks_on(job, host, index)
            key = gpu_key(host, index)
            self.last_bad[key] = sample.time or now
            job.book.raise_(key, "gpu_health", now=now, onset_at=sample.time or now,
                            ranks=ranks, hosts=[host], step=job.max_step, severity="critical",
                            evidence=GpuHealthEvidence(
                                host=host, gpu_index=index, xids=found.xids,
                                ecc_uncorrected_volatile=found.volatile,
                                ecc_uncorrected_aggregate=found.aggregate, gpu=identity,
                                fatal_xids=sorted(self.fatal)))

    @staticmethod
    def _ranks_on(job: JobState, host: str, index: int) -> list[int]:
        """Ranks using that GPU (local rank = GPU index), else every rank of the host."""
        on_host = [r for r in job.ranks.values() if r.host == host and job.current(r)]
        exact = [r.rank for r in on_host if r.local_rank == index]
        return exact or sorted(r.rank for r in on_host)

    def tick(self, job: JobState, now: float) -> None:
        for key in job.book.keys("gpu:"):
            anomaly = job.book.get(key)
            last = self.last_bad.get(key, anomaly.detected_at if anomaly else now)
            if now - last > job.th.gpu_resolve_after:
                self.last_bad.pop(key, None)
                job.book.clear(key, now, quiet_for=round(now - last, 1))
