"""Ranks that crash together are one failure: one diagnosis (so one incident, one page),
whatever their hosts, unless the cause isolates each host."""

from __future__ import annotations

import pytest

from trainguard.contract.errors import ConfigError
from trainguard.contract.evidence import CrashEvidence
from trainguard.contract.schemas import Anomaly, Diagnosis
from trainguard.services.diagnoser.rules import Diagnoser
from trainguard.services.diagnoser.settings import DiagnoserSettings

NOW = 1_000_000.0
TRACE = 'Traceback (most recent call last):\n  File "train.py", line 3\nKeyError: 17'
ECC = "RuntimeError: CUDA error: uncorrectable ECC error encountered"


def crash(rank: int, onset: float, text: str = TRACE) -> Anomaly:
    host = f"h{rank // 4:02d}"
    return Anomaly(id=f"c{rank}", job="j", kind="crash", ranks=[rank], hosts=[host],
                   step=100, onset_at=onset, detected_at=onset + 0.05,
                   evidence=CrashEvidence(source="worker_exit", exit_code=1, stderr_tail=text))


def diagnose(anomalies: list[Anomaly], burst_window: float = 2.0) -> list[Diagnosis]:
    """Every diagnosis revision published, in order, the anomalies arriving as they end."""
    d = Diagnoser(burst_window=burst_window)
    return [x for a in anomalies for x in d.on_anomaly(a, a.detected_at + 0.1).publish]


def test_a_storm_of_crashes_on_many_hosts_is_one_diagnosis_naming_them_all() -> None:
    storm = [crash(r, NOW + 0.01 * r) for r in range(24)]  # 6 hosts' ranks in 0.24 s
    out = diagnose(storm)
    assert len({d.id for d in out}) == 1
    final = out[-1]
    assert final.cause == "process_crash"
    assert final.ranks == list(range(24))
    assert final.hosts == [f"h{i:02d}" for i in range(6)]
    assert sorted(final.anomaly_ids) == sorted(a.id for a in storm)
    assert sum("crashed together" in e.fact for e in final.evidence) == 23


def test_crashes_seconds_apart_on_other_hosts_are_failures_of_their_own() -> None:
    out = diagnose([crash(0, NOW), crash(5, NOW + 5.0)])
    assert len({d.id for d in out}) == 2


def test_crashes_that_isolate_hosts_stay_one_per_host() -> None:
    """Each host's ECC fault isolates that host: joined, the second would not be."""
    out = diagnose([crash(0, NOW, ECC), crash(5, NOW + 0.2, ECC)])
    assert [(d.cause, d.hosts) for d in out] == [("hbm_ecc", ["h00"]), ("hbm_ecc", ["h01"])]


def test_a_window_of_zero_keeps_other_hosts_apart() -> None:
    out = diagnose([crash(0, NOW), crash(5, NOW + 0.1)], burst_window=0.0)
    assert len({d.id for d in out}) == 2


def test_the_window_is_a_checked_setting() -> None:
    assert DiagnoserSettings().burst_window == 2.0
    with pytest.raises(ConfigError, match=r"burst_window=-1\.0"):
        DiagnoserSettings(burst_window=-1.0)
