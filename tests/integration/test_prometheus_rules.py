"""The shipped Prometheus rules pass ``promtool`` (Debian's ``prometheus`` package, installed
by the test when missing): syntax and types (``check rules``), and behaviour (``test
rules`` on deploy/prometheus/rules-test.yml: the alerts fire on the series the services
export, and stay quiet on a healthy job)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.alerting import debian_tool

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"


def test_promtool_accepts_the_rules() -> None:
    promtool = debian_tool("promtool", "prometheus")
    out = subprocess.run([promtool, "check", "rules", str(DEPLOY / "alerts.yml"),
                          str(DEPLOY / "recording.yml")], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("SUCCESS") == 2


def test_the_alerts_fire_where_they_should() -> None:
    promtool = debian_tool("promtool", "prometheus")
    out = subprocess.run([promtool, "test", "rules", str(DEPLOY / "rules-test.yml")],
                         capture_output=True, text=True, timeout=60, check=False, cwd=DEPLOY)
    assert out.returncode == 0, out.stdout + out.stderr
