"""The series worth alerting on: goodput, phase durations, bounded job labels, and the
fixed health ports."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from trainguard.contract.errors import ConfigError
from trainguard.contract.schemas import Incident, PreflightCheck, PreflightReport
from trainguard.runtime.jobmetrics import (
    OTHER,
    CheckpointMetrics,
    Goodput,
    IncidentMetrics,
    JobLabels,
    JobMetrics,
    PreflightMetrics,
    phase_durations,
)
from trainguard.runtime.ports import OFFSETS, PLUGIN_OFFSET, health_port
from trainguard.runtime.state import Progress

ROOT = Path(__file__).resolve().parents[2]


def test_goodput_counts_only_steps_past_the_highest_one() -> None:
    g = Goodput(window_s=100.0)
    assert g.observe(0.0, 0, 1.0) == 1.0           # nothing to judge yet
    for t in range(1, 51):                          # one 1 s step per second: all useful
        value = g.observe(float(t), t, 1.0)
    assert value == pytest.approx(1.0)
    for t in range(51, 61):                         # hung: no progress for 10 s
        value = g.observe(float(t), 50, 1.0)
    assert value == pytest.approx(50 / 60)
    for t in range(61, 81):                         # rolled back to 40: 41..60 in 20 s
        value = g.observe(float(t), 40 + (t - 60), 1.0)
    assert value == pytest.approx((50 + 10) / 80)   # re-done 41..50 are not progress
    for t in range(81, 201):                        # healthy again; the window slides
        value = g.observe(float(t), t - 20, 1.0)
    assert value == pytest.approx(1.0)


def test_phase_durations() -> None:
    inc = Incident(id="i", job="j", cause="oom", onset_at=10.0, detected_at=12.0,
                   mitigated_at=20.0, resolved_at=50.0)
    assert phase_durations(inc) == {"detect": 2.0, "mitigate": 8.0, "recover": 30.0}
    assert phase_durations(Incident(id="i", job="j", cause="oom", detected_at=1.0)) == {}


def test_job_labels_are_bounded() -> None:
    labels = JobLabels(max_jobs=2)
    assert [labels(j) for j in ("a", "b", "c", "a")] == ["a", "b", OTHER, "a"]
    assert labels.forget("a") and not labels.forget("c")
    assert labels("c") == "c"


def test_job_series_follow_progress_and_go_with_the_job() -> None:
    reg = CollectorRegistry()
    m = JobMetrics(reg)
    m.observe(Progress(job="llama", time=0.0, last_step=10, median_step_time=0.5,
                       world_size=4), now=0.0)
    m.observe(Progress(job="llama", time=5.0, last_step=20, median_step_time=0.5,
                       world_size=4), now=5.0)
    got = {k: reg.get_sample_value(f"trainguard_job_{k}", {"training_job": "llama"})
           for k in ("last_step", "step_seconds", "world_size", "goodput_ratio")}
    assert got == {"last_step": 20, "step_seconds": 0.5, "world_size": 4,
                   "goodput_ratio": 1.0}
    m.forget("llama")
    assert reg.get_sample_value("trainguard_job_last_step", {"training_job": "llama"}) is None


def test_incident_series() -> None:
    reg = CollectorRegistry()
    m = IncidentMetrics(reg, "remediator")
    a = Incident(id="a", job="j", cause="oom")
    b = Incident(id="b", job="j", cause="oom")
    m.show_open([a, b])
    assert reg.get_sample_value("trainguard_incidents_open",
                                {"training_job": "j", "cause": "oom"}) == 2
    m.show_open([])
    assert reg.get_sample_value("trainguard_incidents_open",
                                {"training_job": "j", "cause": "oom"}) is None
    done = Incident(id="a", job="j", cause="oom", status="resolved", onset_at=0.0,
                    detected_at=3.0, mitigated_at=10.0, resolved_at=70.0, steps_lost=12)
    m.ended_incident(done)
    assert reg.get_sample_value("trainguard_incident_phase_seconds_sum",
                                {"cause": "oom", "phase": "recover"}) == 60.0
    assert reg.get_sample_value("trainguard_steps_lost_total", {"training_job": "j"}) == 12
    assert reg.get_sample_value("trainguard_incidents_ended_total",
                                {"cause": "oom", "status": "resolved"}) == 1
    assert reg.get_sample_value("trainguard_leader", {"role": "remediator"}) == 0
    m.leading(True)
    assert reg.get_sample_value("trainguard_leader", {"role": "remediator"}) == 1


def test_checkpoint_series_keep_the_newest_good_step() -> None:
    reg = CollectorRegistry()
    m = CheckpointMetrics(reg)
    m.closed_checkpoint("j", 200, "committed", started=90.0, now=100.0)
    m.closed_checkpoint("j", 100, "committed", started=95.0, now=101.0)  # late, older
    m.closed_checkpoint("j", 300, "suspect", started=99.0, now=102.0)
    m.closed_checkpoint("j", 400, "failed", started=99.0, now=103.0)
    labels = {"training_job": "j"}
    assert reg.get_sample_value("trainguard_checkpoint_last_committed_step", labels) == 200
    assert reg.get_sample_value("trainguard_checkpoint_last_committed_timestamp_seconds",
                                labels) == 100.0
    assert reg.get_sample_value("trainguard_checkpoint_commit_seconds_sum") == 16.0
    assert reg.get_sample_value("trainguard_checkpoints_total", {"status": "failed"}) == 1


def test_health_ports() -> None:
    assert health_port("detector", 0) == 0                   # no base: any free port
    assert health_port("detector", 9460) == 9461
    assert health_port("bridge", 9460) == 9465
    plugins = ["zeta", "alpha", "detector"]
    assert health_port("zeta", 9460, plugins) == 9460 + PLUGIN_OFFSET + 1
    assert health_port("alpha", 9460, plugins) == 9460 + PLUGIN_OFFSET
    with pytest.raises(ConfigError, match="base_port=65532"):
        health_port("bridge", 65532)
    with pytest.raises(ConfigError, match="base_port=-1"):
        health_port("bridge", -1)


def test_the_readme_lists_every_fixed_port() -> None:
    readme = (ROOT / "README.md").read_text()
    for name, offset in OFFSETS.items():
        assert re.search(rf"`{name}`[^\n|]*\|\s*\+{offset}\s*\|\s*{9460 + offset}", readme), name


def test_preflight_series_count_each_node_once_and_failed_checks_by_kind() -> None:
    reg = CollectorRegistry()
    m = PreflightMetrics(reg)
    failed = PreflightReport(id="p1", job="j", host="n1", status="fail", seconds=4.2, checks=[
        PreflightCheck(name="ib:mlx5_0/1", status="fail"),
        PreflightCheck(name="ib:mlx5_1/1", status="fail"),
        PreflightCheck(name="nvml.clocks:gpu0", status="warn"),
        PreflightCheck(name="disk", status="ok")])
    m.observe(failed)
    m.observe(failed)  # redelivered: the same node's record
    m.observe(PreflightReport(id="p2", job="j", host="n2", trigger="command"))
    assert reg.get_sample_value("trainguard_preflight_nodes_total",
                                {"status": "fail", "trigger": "launch"}) == 1
    assert reg.get_sample_value("trainguard_preflight_nodes_total",
                                {"status": "ok", "trigger": "command"}) == 1
    assert reg.get_sample_value("trainguard_preflight_checks_total",
                                {"check": "ib", "status": "fail"}) == 2
    assert reg.get_sample_value("trainguard_preflight_checks_total",
                                {"check": "nvml.clocks", "status": "warn"}) == 1
    assert reg.get_sample_value("trainguard_preflight_checks_total",
                                {"check": "disk", "status": "ok"}) is None
    assert reg.get_sample_value("trainguard_preflight_seconds_count") == 1
