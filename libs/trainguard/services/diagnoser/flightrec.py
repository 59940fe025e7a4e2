"""Culprits of a hang from the agents' flight-recorder dumps (``FlightRecorderReport``).

The remediator's first step for a hang is ``dump``; each agent asked answers with its
ranks' c10d flight-recorder records (:mod:`trainguard.agent.flightrec`). This
module keeps the job's recent reports, analyses them together
(:func:`trainguard.analysis.flightrec.analyse`: the ranks the others wait on, per process group,
with ranks asked but silent counted as missing) and, when that names culprits, updates the
job's open hang diagnosis: the culprits become its ranks (and their hosts), the analysis its
evidence, and a guess of ``network`` or ``unknown`` (every rank seemed to wait in the
collective) becomes ``rank_hang``. Pure: the service feeds it reports and publishes what it
returns.
"""

from __future__ import annotations

import collections
from typing import Final

import msgspec

from trainguard.analysis import flightrec
from trainguard.contract.schemas import Diagnosis, EvidenceItem, FlightRecorderReport

from .knowledge import RECOMMENDED
from .rules import Decision, Diagnoser

HANG_CAUSES: Final = frozenset({"rank_hang", "network", "unknown"})
"""Open diagnoses a flight-recorder analysis may name the culprits of."""
WINDOW_S: Final = 60.0


class FlightRecorder:
    def __init__(self, window: float = WINDOW_S) -> None:
        self.window = window
        self.reports: dict[str, collections.deque[FlightRecorderReport]] = \
            collections.defaultdict(lambda: collections.deque(maxlen=256))

    def on_report(self, rules: Diagnoser, report: FlightRecorderReport,
                  now: float) -> Decision:
        job = report.job
        kept = self.reports[job]
        if any(r.id == report.id for r in kept):
            return Decision()  # redelivered
        kept.append(report)
        recent = [r for r in kept if now - r.time <= self.window]
        analysis, hosts = analyse(recent)
        target = _open_hang(rules, job)
        if target is None or not analysis.culprits or _says(target, analysis):
            return Decision()
        return Decision([_update(target, analysis, hosts)])


def analyse(reports: list[FlightRecorderReport]) -> tuple[flightrec.Analysis, dict[int, str]]:
    """All reports' records together (the newest per rank); rank → host as reported."""
    records: dict[int, flightrec.RankRecord] = {}
    hosts: dict[int, str] = {}
    asked: set[int] = set()
    for rep in sorted(reports, key=lambda r: r.time):
        asked |= set(rep.evidence.asked)
        for rank in rep.evidence.asked:
            hosts[rank] = rep.host
        for rec in rep.evidence.records:
            records[rec.rank] = rec
    return flightrec.analyse(records.values(), expected=asked, scope=asked), hosts


def _open_hang(rules: Diagnoser, job: str) -> Diagnosis | None:
    for o in reversed(rules.open.get(job, [])):
        d = o.diagnosis
        if d.status == "open" and d.cause in HANG_CAUSES:
            return d
    return None


def _says(d: Diagnosis, a: flightrec.Analysis) -> bool:
    """``d`` already carries this analysis' verdict (a later dump that agrees)."""
    return d.cause == "rank_hang" and d.ranks == a.culprits and any(
        e.source == "flight_recorder" for e in d.evidence)


def _update(d: Diagnosis, a: flightrec.Analysis, hosts: dict[int, str]) -> Diagnosis:
    groups = ", ".join(a.culprit_groups()[:6]) or "-"
    d.evidence.append(EvidenceItem(
        fact=f"flight-recorder dumps: ranks {a.culprits} stopped short in process groups "
             f"{groups}" + (f" (no dump from {a.missing})" if a.missing else ""),
        source="flight_recorder", value=msgspec.to_builtins(a)))
    if d.cause != "rank_hang":
        d.cause = "rank_hang"
        d.recommended = list(RECOMMENDED["rank_hang"])
    d.ranks = list(a.culprits)
    d.hosts = sorted({hosts[r] for r in a.culprits if r in hosts}) or d.hosts
    d.summary = (f"ranks {', '.join(map(str, a.culprits))} on {', '.join(d.hosts)}: rank hang "
                 f"(flight recorder: stopped short in {groups}); recommend "
                 f"{' -> '.join(d.recommended)}")
    d.rev += 1
    return d
