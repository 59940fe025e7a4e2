"""Windows, the anomaly book, thresholds, settings, and rebuilding after a restart."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from trainguard.contract.errors import ConfigError
from trainguard.contract.evidence import (
    CrashEvidence,
    HangEvidence,
    NonfiniteEvidence,
    UnresponsiveEvidence,
)
from trainguard.runtime import xids
from trainguard.runtime.config import Settings, load_settings
from trainguard.services.detector.book import AnomalyBook, Transition, dump_anomaly, load_anomaly
from trainguard.services.detector.engine import Detector
from trainguard.services.detector.leases import preferred
from trainguard.services.detector.settings import DetectorSettings
from trainguard.services.detector.synthetic import Harness, SimConfig
from trainguard.services.detector.thresholds import Thresholds, thresholds_of, with_job_overrides
from trainguard.services.detector.windows import FlagHistory, Ring, median, median_mad


def test_ring_keeps_the_newest_values_and_robust_statistics() -> None:
    ring = Ring(5)
    assert ring.median() is None and ring.quantile(0.99) is None
    ring.extend([1.0, 2.0, 3.0, 4.0, 100.0, 5.0, 6.0])
    assert ring.values() == [3.0, 4.0, 100.0, 5.0, 6.0] and ring.full
    assert ring.median() == 5.0 and ring.quantile(0.99) == 100.0 and ring.max() == 100.0
    assert ring.median_mad() == (5.0, 1.0)
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert median_mad([1.0, 1.0, 1.0, 9.0]) == (1.0, 0.0)
    with pytest.raises(ValueError):
        Ring(0)


def test_flag_history_counts_within_its_window() -> None:
    h = FlagHistory(3)
    for flag in (True, True, False, True):
        h.push(flag)
    assert h.count == 2 and h.full
    h.push(False)
    h.push(False)
    assert h.count == 1


def test_book_raises_once_widens_and_resolves_with_the_same_id() -> None:
    outbox: list[Transition] = []
    book = AnomalyBook("j", outbox, new_id=lambda: "x1")
    first = book.raise_("unresponsive:h", "unresponsive", now=2.0, onset_at=1.0, ranks=[3],
                        hosts=["h"])
    assert first is not None and first.rev == 1 and first.status == "open"
    assert book.raise_("unresponsive:h", "unresponsive", now=3.0, onset_at=1.0, ranks=[3],
                       hosts=["h"]) is None
    wider = book.raise_("unresponsive:h", "unresponsive", now=4.0, onset_at=1.0, ranks=[4],
                        hosts=["h"])
    assert wider is not None and (wider.id, wider.rev, wider.ranks) == ("x1", 2, [3, 4])
    assert book.raise_("hang", "hang", now=4.0, onset_at=1.0, ranks=[1]) is not None
    assert book.raise_("hang", "hang", now=5.0, onset_at=1.0, ranks=[2], widen=False) is None
    done = book.clear("unresponsive:h", 9.0)
    assert done is not None and (done.id, done.rev, done.status) == ("x1", 3, "resolved")
    assert done.resolved_at == 9.0 and done.evidence == UnresponsiveEvidence()
    assert book.clear("unresponsive:h", 10.0) is None
    resumed = book.clear("hang", 9.0, resumed_step=7)
    assert resumed is not None and resumed.evidence == HangEvidence(resumed_step=7)
    assert [t.anomaly.rev for t in outbox] == [1, 2, 1, 3, 2]


def test_book_evidence_must_be_the_kinds_and_resolution_fields_must_exist() -> None:
    book = AnomalyBook("j", [], new_id=lambda: "x1")
    with pytest.raises(TypeError, match="evidence of a hang anomaly"):
        book.raise_("hang", "hang", now=1.0, onset_at=1.0, ranks=[1],
                    evidence=CrashEvidence(exit_code=1))
    book.raise_("hang", "hang", now=1.0, onset_at=1.0, ranks=[1], evidence=HangEvidence())
    with pytest.raises(TypeError, match="no field 'why'"):
        book.clear("hang", 2.0, why="back")


def test_stored_anomalies_keep_non_finite_evidence() -> None:
    outbox: list[Transition] = []
    book = AnomalyBook("j", outbox)
    a = book.raise_("nonfinite", "nonfinite", now=1.0, onset_at=1.0, ranks=[0],
                    evidence=NonfiniteEvidence(loss={"0": float("nan")},
                                               grad_norm={"0": float("inf")}))
    assert a is not None
    stored = dump_anomaly(a)
    assert '"loss":{"0":"nan"}' in stored and '"grad_norm":{"0":"inf"}' in stored
    back = load_anomaly(stored)
    assert back.id == a.id and isinstance(back.evidence, NonfiniteEvidence)
    assert math.isnan(back.evidence.loss["0"]) and back.evidence.grad_norm["0"] == math.inf


def test_restarted_detector_does_not_re_alert_and_resolves_with_the_old_id() -> None:
    h = Harness(Thresholds(), SimConfig(ranks=8))
    h.sim.steps(100)
    h.sim.stall(20.0, lambda r: "data" if r == 6 else "comm")
    [hang] = h.opened()
    stored = {"hang": load_anomaly(dump_anomaly(hang))}
    progress = h.detector.progress("sim", h.clock)
    # A new detector process takes over with what the first one left in Redis.
    fresh = Detector(Thresholds(), clock=lambda: h.clock)
    fresh.restore("sim", stored, progress, h.clock)
    h.detector = fresh
    h.sim.stall(30.0, lambda r: "data" if r == 6 else "comm")
    assert h.collect() == [] and len(h.events) == 1
    h.sim.steps(3)
    [resolved] = h.resolved()
    assert (resolved.id, resolved.rev, resolved.status) == (hang.id, 2, "resolved")


def test_restored_straggler_resolves_when_the_rank_recovers() -> None:
    h = Harness(Thresholds(), SimConfig(ranks=8))
    h.sim.steps(20)
    h.sim.slow[1] = 1.6
    h.sim.steps(12)
    [slow] = h.opened()
    fresh = Detector(Thresholds(), clock=lambda: h.clock)
    fresh.restore("sim", {"straggler:1": slow}, h.detector.progress("sim", h.clock), h.clock)
    h.detector = fresh
    h.sim.steps(10)
    assert h.collect() == []
    h.sim.slow.clear()
    h.sim.steps(12)
    assert [a.id for a in h.resolved()] == [slow.id]


def test_job_overrides_apply_known_fields_and_report_bad_values() -> None:
    base = Thresholds()
    th, rejected = with_job_overrides(base, {
        "TRAINGUARD_HANG_FLOOR": "30", "TRAINGUARD_STRAGGLER_PATIENCE": "6",
        "TRAINGUARD_HB_TIMEOUT": "-1", "TRAINGUARD_NATS_URL": "x", "PATH": "/bin"})
    assert th.hang_floor == 30.0 and th.straggler_patience == 6 and th.hb_timeout == 5.0
    assert rejected == ["TRAINGUARD_HB_TIMEOUT='-1': must be a non-negative number"]
    assert with_job_overrides(base, {})[0] is base
    assert th.phase_set("long_phases") == {"checkpoint", "eval"}
    assert th.xid_set() == xids.fatal_codes() and {48, 64, 74, 79, 95} <= th.xid_set()
    mine, _ = with_job_overrides(base, {"TRAINGUARD_FATAL_XIDS": "48, 79"})
    assert mine.xid_set() == {48, 79}


def test_detector_settings_load_thresholds_from_the_environment() -> None:
    s = load_settings(DetectorSettings, env={"TRAINGUARD_STRAGGLER_RATIO": "1.5",
                                             "TRAINGUARD_LEASE_TTL": "4"})
    assert s.straggler_ratio == 1.5 and s.lease_ttl == 4.0 and s.prefix == "tg"
    assert thresholds_of(s) == Thresholds(straggler_ratio=1.5)
    with pytest.raises(ConfigError, match="unknown setting 'hang_flor'"):
        load_settings(DetectorSettings, env={}, overrides={"hang_flor": 3})


def test_rendezvous_hashing_spreads_jobs_and_is_stable() -> None:
    instances = ["det-a", "det-b", "det-c"]
    owners = [preferred(f"job-{i}", instances) for i in range(300)]
    counts = {i: owners.count(i) for i in instances}
    assert all(60 < n < 140 for n in counts.values()), counts
    # Removing one instance moves only its own jobs.
    survivors = ["det-a", "det-b"]
    for i, owner in enumerate(owners):
        if owner != "det-c":
            assert preferred(f"job-{i}", survivors) == owner
    assert preferred("job", []) is None


def test_every_setting_is_documented_in_the_readme() -> None:
    readme = (Path(__file__).resolve().parents[2] / "libs" / "trainguard" / "services" / "detector"
              / "README.md")
    text = readme.read_text()
    own = {f.name for f in dataclasses.fields(DetectorSettings)} - {
        f.name for f in dataclasses.fields(Settings)}
    missing = sorted(name for name in own if f"`{name}`" not in text)
    assert missing == []


def test_expected_ranks_stay_right_through_joins_exits_and_restarts() -> None:
    from trainguard.contract.schemas import Attempt, RankHello, WorkerExit

    h = Harness(Thresholds(), SimConfig(ranks=6))
    d, job = h.detector, h.job

    def recounted() -> int:
        here = [r for r in job.ranks.values() if job.current(r)]
        active = sum(1 for r in here if not r.exited)
        declared = job.world_size - (len(here) - active) \
            if job.world_incarnation == job.incarnation else 0
        return max(active, declared, 1)

    h.sim.steps(3)
    assert job.expected == recounted() == 6
    d.on_exit(WorkerExit(id="x", job="sim", host="node-0", rank=2, exit_code=1,
                         time=h.clock), h.clock)
    assert job.expected == recounted() == 5
    d.on_hello(RankHello(job="sim", rank=2, world_size=6, time=h.clock), h.clock)
    assert job.expected == recounted() == 6
    h.sim.attempt = 1
    h.sim.steps(2)
    assert job.attempt == 1 and job.expected == recounted() == 6
    d.on_hello(RankHello(job="sim", rank=0, world_size=8, attempt=Attempt(restart_count=1),
                         time=h.clock), h.clock)
    assert job.expected == recounted() == 8
