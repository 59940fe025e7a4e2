"""A rank's start: with trainguard on, and with ``TRAINGUARD_DISABLED=1``, a real gloo job
reaches its first step within the same bound (how fast is ``bench/bench_start.py``'s)."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any

from tests.conftest import wait_until
from tests.e2e.conftest import job_env, torchrun
from tests.tap import tapped
from trainguard.contract.schemas import StepReport

FIRST_STEP_BOUND = 120.0
"""Seconds from a rank's process start to its first step: generous for 2 busy cores (a
plain torch rank takes a few seconds here); both variants must meet the same one."""


def _start(nats_url: str, prefix: str, job: str, out: Path, log: Path,
           procs: list[subprocess.Popen[bytes]], **env: str) -> subprocess.Popen[bytes]:
    out.mkdir()
    # job_env drops an inherited TRAINGUARD_DISABLED; this test sets its own after it.
    proc = torchrun(2, ["--mode", "trainguard", "--job", job, "--out", str(out)],
                    {**job_env(nats_url, prefix), **env}, log,
                    module="trainguard.examples.first_step")
    procs.append(proc)
    return proc


async def _records(proc: subprocess.Popen[bytes], out: Path, log: Path) -> list[dict[str, Any]]:
    code = await asyncio.to_thread(proc.wait, 160)
    assert code == 0, log.read_text()[-4000:]
    records = [json.loads(f.read_text()) for f in sorted(out.glob("rank-*.json"))]
    assert [r["rank"] for r in records] == [0, 1]
    return records


async def test_disabled_and_enabled_ranks_reach_their_first_step_within_one_bound(
        nats_url: str, prefix: str, job: str, tmp_path: Path,
        procs: list[subprocess.Popen[bytes]]) -> None:
    on_dir, off_dir = tmp_path / "on", tmp_path / "off"
    async with tapped(nats_url, prefix, job) as (tap, _):
        # Both jobs start together, so a busy machine burdens them alike.
        on_proc = _start(nats_url, prefix, job, on_dir, tmp_path / "on.log", procs)
        off_proc = _start(nats_url, prefix, job + "-off", off_dir, tmp_path / "off.log",
                          procs, TRAINGUARD_DISABLED="1")
        on, off = await asyncio.gather(_records(on_proc, on_dir, tmp_path / "on.log"),
                                       _records(off_proc, off_dir, tmp_path / "off.log"))
        # The enabled job really ran trainguard: both ranks said hello and reported steps.
        await wait_until(lambda: {r.rank for r in tap.of(StepReport)} == {0, 1}, timeout=30,
                         what="step reports from both enabled ranks")
    assert {h.rank for h in tap.hellos} == {0, 1}
    assert not any(r["disabled"] for r in on) and all(r["disabled"] for r in off)
    for record in (*on, *off):
        took = record["first_step"] - record["process_start"]
        assert 0 < took < FIRST_STEP_BOUND, record
        assert record["process_start"] <= record["imported"] <= record["pg_ready"] \
            <= record["first_step"]
