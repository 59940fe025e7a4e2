"""GPU health from the agent's samples: fatal XIDs and rising uncorrectable ECC counts.

A GPU that logs XID 79 (fallen off the bus) or 48 (double-bit ECC) is lost to the job,
often before any rank has noticed; alerting on the sample lets the diagnoser and the
remediator start (save-now, isolate) while the ranks are still alive. ECC counters are
judged by their *rise* between samples: a non-zero aggregate count is history, a count
that grows is a GPU failing now.
"""

from __future__ import annotations

from typing import Any

from trainguard.schemas import GpuSample

from .job import JobState

ECC_FIELDS = ("ecc_uncorrected_volatile", "ecc_uncorrected_aggregate")
MAX_SEEN_XIDS = 1024


def gpu_key(host: str, gpu: int) -> str:
    return f"gpu:{host}:{gpu}"


class GpuHealth:
    """Fatal XIDs and ECC growth per (host, GPU) of one job."""

    def __init__(self, job: JobState) -> None:
        self.fatal = job.th.xid_set()
        self.ecc: dict[tuple[str, int, str], int] = {}
        self.seen: set[tuple[str, int, int, float]] = set()
        self.last_bad: dict[str, float] = {}

    def on_sample(self, job: JobState, sample: GpuSample, now: float) -> None:
        host = sample.host
        findings: dict[int, dict[str, Any]] = {}
        for x in sample.xids:
            ident = (host, x.gpu, x.code, x.time)
            if x.code not in self.fatal or ident in self.seen:
                continue
            if len(self.seen) >= MAX_SEEN_XIDS:
                self.seen.clear()
            self.seen.add(ident)
            findings.setdefault(x.gpu, {}).setdefault("xids", []).append(
                {"code": x.code, "time": x.time, "detail": x.detail})
        for g in sample.gpus:
            for field in ECC_FIELDS:
                value = getattr(g, field)
                if value is None:
                    continue
                previous = self.ecc.get((host, g.index, field))
                self.ecc[(host, g.index, field)] = value
                if previous is not None and value > previous:
                    findings.setdefault(g.index, {})[field] = {"from": previous, "to": value}
        by_index = {g.index: g for g in sample.gpus}
        for index, evidence in findings.items():
            stats = by_index.get(index)
            if stats is not None:
                evidence["gpu"] = {"uuid": stats.uuid, "name": stats.name,
                                   "temperature_c": stats.temperature_c,
                                   "remapped_rows_pending": stats.remapped_rows_pending,
                                   "retired_pages_pending": stats.retired_pages_pending}
            evidence["fatal_xids"] = sorted(self.fatal)
            ranks = self._ranks_on(job, host, index)
            key = gpu_key(host, index)
            self.last_bad[key] = sample.time or now
            job.book.raise_(key, "gpu_health", now=now, onset_at=sample.time or now,
                            ranks=ranks, hosts=[host], step=job.max_step, severity="critical",
                            evidence={"host": host, "gpu_index": index, **evidence})

    @staticmethod
    def _ranks_on(job: JobState, host: str, index: int) -> list[int]:
        """Ranks using that GPU (local rank = GPU index), else every rank of the host."""
        on_host = [r for r in job.ranks.values() if r.host == host and r.attempt == job.attempt]
        exact = [r.rank for r in on_host if r.local_rank == index]
        return exact or sorted(r.rank for r in on_host)

    def tick(self, job: JobState, now: float) -> None:
        for key in job.book.keys("gpu:"):
            anomaly = job.book.get(key)
            last = self.last_bad.get(key, anomaly.detected_at if anomaly else now)
            if now - last > job.th.gpu_resolve_after:
                self.last_bad.pop(key, None)
                job.book.clear(key, now, {"quiet_for": round(now - last, 1)})
