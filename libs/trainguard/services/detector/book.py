"""Open anomalies of a job: one per onset, updated in place, resolved once.

Rules describe conditions ("rank 3 has been silent since t"); the book turns them into
events. A condition that is still true on the next tick does not raise again: it is the
same anomaly, so a hang that lasts a minute is one event and, when progress resumes, one
resolved update with the same ``id`` and ``rev + 1``. If a condition grows (a second rank
of the host goes silent), the anomaly is republished open with the larger rank set.

Every change lands in an outbox the service drains, persists and publishes. The book can
be rebuilt from what the service persisted, so a restarted detector (or a new owner of
the job) knows what is already open and does not alert twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from trainguard.contract.codec import decode_durable, encode_durable
from trainguard.contract.envelope import uuid7
from trainguard.contract.evidence import BY_KIND, Evidence
from trainguard.contract.schemas import Anomaly, AnomalyKind, Severity


@dataclasses.dataclass(frozen=True, slots=True)
class Transition:
    """One change of one anomaly, to be persisted and published in order."""

    job: str
    key: str
    anomaly: Anomaly


class AnomalyBook:
    """The open anomalies of one job, keyed by what each is about (``hang``, ``crash:3:0``).

    Args:
        job: the job this book belongs to.
        outbox: where transitions go (shared by all jobs of a detector, in order).
        new_id: the id factory (uuid7 by default; tests pass a counter).
    """

    def __init__(self, job: str, outbox: list[Transition],
                 new_id: Callable[[], str] = uuid7) -> None:
        self.job = job
        self.open: dict[str, Anomaly] = {}
        self._outbox = outbox
        self._new_id = new_id

    def is_open(self, key: str) -> bool:
        return key in self.open

    def get(self, key: str) -> Anomaly | None:
        return self.open.get(key)

    def keys(self, prefix: str) -> list[str]:
        """Open keys starting with ``prefix`` (the book is small: a scan is fine)."""
        return [k for k in self.open if k.startswith(prefix)]

    def raise_(self, key: str, kind: AnomalyKind, *, now: float, onset_at: float,
               ranks: Iterable[int], hosts: Iterable[str] = (), step: int | None = None,
               severity: Severity = "warning", evidence: Evidence | None = None,
               widen: bool = True) -> Anomaly | None:
        """Open an anomaly for ``key``, or widen the open one; None if nothing changed.

        ``evidence`` must be the Struct of ``kind`` (none: the kind's empty one).
        ``widen=False`` keeps an open anomaly as first raised (a hang's culprits are the
        ones seen at its onset; ranks that move while the job recovers are not).
        """
        rank_set = set(ranks)
        host_set = {h for h in hosts if h}
        current = self.open.get(key)
        if current is None:
            anomaly = Anomaly(
                id=self._new_id(), job=self.job, kind=kind, ranks=sorted(rank_set),
                hosts=sorted(host_set), step=step, onset_at=onset_at, detected_at=now,
                severity=severity,
                evidence=evidence if evidence is not None else BY_KIND[kind]())
        else:
            if not widen:
                return None
            grown_ranks = rank_set - set(current.ranks)
            grown_hosts = host_set - set(current.hosts)
            if not grown_ranks and not grown_hosts:
                return None
            anomaly = msgspec.structs.replace(
                current, ranks=sorted(rank_set | set(current.ranks)),
                hosts=sorted(host_set | set(current.hosts)),
                evidence=evidence if evidence is not None else current.evidence,
                rev=current.rev + 1)
        self.open[key] = anomaly
        self._outbox.append(Transition(self.job, key, anomaly))
        return anomaly

    def clear(self, key: str, now: float, **resolution: Any) -> Anomaly | None:
        """Resolve the open anomaly for ``key`` (same id, ``rev + 1``); None if none.

        ``resolution`` sets fields of its evidence (``resumed_step=...``): names its kind's
        Struct does not have are a TypeError.
        """
        current = self.open.pop(key, None)
        if current is None:
            return None
        evidence = msgspec.structs.replace(current.evidence, **resolution)
        resolved = msgspec.structs.replace(current, status="resolved", rev=current.rev + 1,
                                           resolved_at=now, evidence=evidence)
        self._outbox.append(Transition(self.job, key, resolved))
        return resolved

    def restore(self, key: str, anomaly: Anomaly) -> None:
        """Adopt an anomaly persisted by an earlier run; it raises nothing now."""
        if anomaly.status == "open":
            self.open[key] = anomaly


def dump_anomaly(anomaly: Anomaly) -> str:
    """JSON for Redis, with non-finite evidence values kept as strings (see codec)."""
    return encode_durable(anomaly).decode()


def load_anomaly(raw: str | bytes) -> Anomaly:
    return decode_durable(raw.encode() if isinstance(raw, str) else raw, Anomaly)
