"""Which open failure a symptom follows from: by what the symptom is, not by when it came.

A throughput drop while one rank straggles is the straggler's effect, however long the
straggler has lasted; paging a human for it as ``unknown`` teaches on-call to ignore the
pager. So the diagnoser keeps, per job, the anomalies the detector still holds open (it
sees every transition on the event stream) and :data:`ABSORBED_BY` says which of them
explain a symptom. A symptom they explain joins the diagnosis of that root as collateral
(its revision lists it in ``Diagnosis.collateral``): it never opens a diagnosis, nor an
incident, of its own.

The time-window rules of :mod:`.rules` stay for what has no open root to point at: a hang
or silence shortly after a root failure, a peer's collective error after the first exit.
The detector's side of the same idea is in :mod:`trainguard.services.detector.numerics`:
loss and gradient baselines restart when the job is re-formed, so there is nothing to absorb.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

from trainguard.contract.schemas import Anomaly, AnomalyKind

ABSORBED_BY: dict[AnomalyKind, frozenset[AnomalyKind]] = {
    # Every failure that slows or stops the job's steps, or restarts it, lowers throughput.
    "throughput_drop": frozenset({
        "straggler", "hang", "checkpoint_slow", "data_stall", "crash", "unresponsive",
        "gpu_health", "nonfinite", "sdc_mismatch", "bad_batch",
    }),
}
"""symptom kind -> the anomaly kinds that, while open on the same job, explain it."""


RESOLVED_MEMORY = 10_000
"""Resolved anomaly ids remembered, so a late redelivery of an open revision cannot
reopen one."""


class OpenAnomalies:
    """Per job, the anomalies the detector has raised and not resolved yet (id -> kind)."""

    def __init__(self) -> None:
        self._open: dict[str, dict[str, AnomalyKind]] = collections.defaultdict(dict)
        self._resolved: collections.OrderedDict[str, None] = collections.OrderedDict()

    def observe(self, a: Anomaly) -> None:
        """Follow one transition (``open`` or ``resolved``) of an anomaly."""
        if a.status == "resolved":
            opened = self._open.get(a.job)
            if opened is not None:
                opened.pop(a.id, None)
                if not opened:
                    del self._open[a.job]
            self._resolved[a.id] = None
            while len(self._resolved) > RESOLVED_MEMORY:
                self._resolved.popitem(last=False)
        elif a.id not in self._resolved:
            self._open[a.job][a.id] = a.kind

    def is_open(self, job: str, ident: str) -> bool:
        return ident in self._open.get(job, {})

    def roots_of(self, a: Anomaly) -> set[str]:
        """Ids of the open anomalies of ``a``'s job that explain ``a`` (empty: none)."""
        kinds = ABSORBED_BY.get(a.kind)
        if not kinds:
            return set()
        return {ident for ident, kind in self._open.get(a.job, {}).items()
                if kind in kinds and ident != a.id}

    def any_open(self, job: str, ids: Iterable[str]) -> bool:
        opened = self._open.get(job, {})
        return any(i in opened for i in ids)
