"""Which open root absorbs a symptom (docs/design.md section 6, "Symptoms and their roots").

Each row: the anomalies that came first (and whether the detector has resolved them by
then), the symptom, and where the symptom must end up: joined to the first anomaly's
diagnosis as collateral, or a diagnosis of its own with the cause named.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.unit.test_diagnoser_rules import (
    ALL_IN_COMM,
    NOW,
    OOM,
    TRACE,
    anomaly,
    crash,
    exit_of,
    hang,
)
from trainguard.contract.evidence import (
    CheckpointSlowEvidence,
    DataStallEvidence,
    Evidence,
    StragglerEvidence,
    ThroughputDropEvidence,
)
from trainguard.contract.schemas import Anomaly, Diagnosis
from trainguard.services.diagnoser.rules import Diagnoser

EVERYONE = [0, 1, 2, 3]
BOTH = ["node-a", "node-b"]
STUCK = {"culprits": [1], "culprit_basis": "process_state", "majority_phase": "comm"}


def of(evidence: Evidence, ranks: list[int], hosts: list[str], ident: str) -> Anomaly:
    return anomaly(evidence, ranks, hosts, ident)


def drop(ident: str = "drop") -> Anomaly:
    return of(ThroughputDropEvidence(baseline=100.0, recent=40.0, ratio=0.4), EVERYONE, BOTH,
              ident)


@dataclass
class Row:
    name: str
    first: Anomaly
    symptom: Anomaly
    after: float
    """Seconds between the first anomaly and the symptom."""
    joins: bool
    cause: str = ""
    """The symptom's own cause when it does not join."""
    resolved_first: bool = False


ROWS = [
    Row("throughput drop while a rank straggles", of(StragglerEvidence(ratio=2.5), [1],
        ["node-a"], "s1"), drop(), 0.3, joins=True),
    Row("throughput drop an hour into a straggler still open",
        of(StragglerEvidence(ratio=2.5), [1], ["node-a"], "s1"), drop(), 3600.0, joins=True),
    Row("throughput drop while a rank hangs", hang([1], ["node-a"], "h1", **STUCK), drop(),
        5.0, joins=True),
    Row("throughput drop while every rank waits in comm",
        hang(EVERYONE, BOTH, "h1", **ALL_IN_COMM), drop(), 5.0, joins=True),
    Row("throughput drop while checkpoints stall", of(CheckpointSlowEvidence(), [0],
        ["node-a"], "k1"), drop(), 30.0, joins=True),
    Row("throughput drop while the data loader stalls", of(DataStallEvidence(), [0],
        ["node-a"], "d1"), drop(), 30.0, joins=True),
    Row("throughput drop while a crashed rank restarts", crash(1, "node-a", TRACE, "c1"),
        drop(), 45.0, joins=True),
    Row("throughput drop after the straggler resolved is its own",
        of(StragglerEvidence(ratio=2.5), [1], ["node-a"], "s1"), drop(), 30.0, joins=False,
        cause="unknown", resolved_first=True),
    Row("a crash is never absorbed by a straggler", of(StragglerEvidence(ratio=2.5), [1],
        ["node-a"], "s1"), crash(2, "node-b", OOM, "c2"), 5.0, joins=False, cause="oom"),
    Row("a peer's collective error after a rank died is collateral",
        crash(3, "node-b", OOM, "c3"),
        crash(0, "node-a", "RuntimeError: Connection closed by peer", "c0"), 1.0, joins=True),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_symptom_and_root(row: Row) -> None:
    d = Diagnoser()
    if row.first.kind == "crash":
        d.observe_exit(exit_of(row.first.ranks[0], row.first.hosts[0],
                               row.first.evidence.stderr_tail, NOW - 1))  # type: ignore[union-attr]
    if row.symptom.kind == "crash":
        d.observe_exit(exit_of(row.symptom.ranks[0], row.symptom.hosts[0],
                               row.symptom.evidence.stderr_tail,  # type: ignore[union-attr]
                               NOW + row.after - 0.5))
    (root,) = d.on_anomaly(row.first, NOW).publish
    if row.resolved_first:
        done = Anomaly(**{**{f: getattr(row.first, f) for f in row.first.__struct_fields__},
                          "status": "resolved", "rev": 2})
        assert d.on_anomaly(done, NOW + row.after / 2).publish == []
    rev = root.rev
    published = d.on_anomaly(row.symptom, NOW + row.after).publish
    if row.joins:
        [joined] = published
        assert joined.id == root.id and joined.rev == rev + 1
        assert joined.cause == root.cause and joined.ranks == root.ranks
        assert joined.anomaly_ids[-1] == row.symptom.id
        assert row.symptom.id in joined.collateral
    else:
        [own] = [p for p in published if p.id != root.id]
        assert own.cause == row.cause and own.collateral == []


def test_a_drop_before_the_straggler_is_superseded_by_it() -> None:
    """The other order: the drop comes first (an ``unknown`` guess naming every rank), the
    straggler on one of those ranks follows within the grace the remediator gives a guess."""
    d = Diagnoser()
    (guess,) = d.on_anomaly(drop(), NOW).publish
    assert guess.cause == "unknown"
    old, root = d.on_anomaly(of(StragglerEvidence(ratio=2.5), [1], ["node-a"], "s1"),
                             NOW + 2).publish
    assert old.id == guess.id and old.status == "superseded" and old.superseded_by == root.id
    assert root.cause == "straggler" and set(root.anomaly_ids) == {"drop", "s1"}


def test_a_symptom_joins_the_root_that_superseded_its_diagnosis() -> None:
    d = Diagnoser()
    (guess,) = d.on_anomaly(hang(EVERYONE, BOTH, "h1", **ALL_IN_COMM), NOW).publish
    published = d.on_anomaly(crash(2, "node-b", OOM, "c2"), NOW + 1).publish
    root: Diagnosis = published[-1]
    assert root.cause == "oom" and guess.id in {p.id for p in published}
    (joined,) = d.on_anomaly(drop(), NOW + 3).publish
    assert joined.id == root.id and "drop" in joined.collateral
