"""Real DCP checkpoints from 2-rank gloo jobs under torchrun, committed by the coordinator.

* A job killed mid-run resumes from the coordinator's resume point with parameters,
  optimizer state, step and RNG exactly as saved, and its losses from there on equal those
  of a run that was never interrupted.
* A committed checkpoint that no longer loads (a file gone) is skipped for the previous
  committed one, and the job is told; when none loads the rank refuses to start from 0.
* save-now returns the committed step within its deadline; when one rank ignores it, the
  other's save times out on the side group and the answer names the rank that did not
  report.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import wait_until
from tests.e2e.conftest import job_env
from tests.integration.test_checkpointer import coordinator
from tests.tap import tapped
from trainguard.contract.schemas import RecoveryReport, StepReport
from trainguard.runtime.embedded import free_port

TRAINER = "tests.e2e.ckpt_trainer"


Job = tuple[subprocess.Popen[bytes], Path]


@pytest.fixture
def jobs() -> Iterator[list[Job]]:
    """torchrun jobs this test started (launcher and the out directory of its workers);
    whatever still runs at the end is killed, by pid."""
    started: list[Job] = []
    yield started
    for job in started:
        kill(job)


def start(jobs: list[Job], args: Sequence[str], env: dict[str, str], out: Path,
          log: Path) -> Job:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
           "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "--local-addr", "127.0.0.1",
           "-m", TRAINER, "--out", str(out), *args]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                cwd=Path(__file__).parents[2])
    jobs.append((proc, out))
    return proc, out


def kill(job: Job) -> None:
    """SIGKILL the job's workers (pids they wrote) and its launcher: a crash, mid-step."""
    proc, out = job
    for pid_file in out.glob("pid-rank*"):
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


async def finish(job: Job, log: Path, timeout: float = 120) -> None:
    proc, _ = job
    code = await asyncio.to_thread(proc.wait, timeout)
    assert code == 0, log.read_text()[-4000:]


def losses(out: Path, rank: int) -> dict[int, str]:
    lines = (out / f"losses-rank{rank}.txt").read_text().split("\n")
    return {int(s): v for s, v in (line.split() for line in lines if line.strip())}


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Recursive exact equality of state dicts (tensors bit for bit)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


async def test_killed_job_resumes_bit_for_bit(nats_url: str, redis_url: str, prefix: str,
                                              job: str, tmp_path: Path,
                                              jobs: list[Job]) -> None:
    root = tmp_path / "ckpt"
    env = job_env(nats_url, prefix)
    ref_out, a_out, b_out = tmp_path / "ref", tmp_path / "a", tmp_path / "b"
    common = ["--root", str(root), "--every", "5", "--step-time", "0.03"]
    async with coordinator(nats_url, redis_url, prefix, job) as c:
        ref = start(jobs, ["--job", f"{job}-ref", "--steps", "30", *common], env, ref_out,
                    tmp_path / "ref.log")
        first = start(jobs, ["--job", job, "--steps", "100000", *common], env, a_out,
                      tmp_path / "a.log")
        await c.event(14, "committed", timeout=90)
        await wait_until(lambda: len(list(a_out.glob("pid-rank*"))) == 2, what="worker pids")
        kill(first)  # SIGKILL to every process of the job, mid-run
        await finish(ref, tmp_path / "ref.log")
        point = await c.resume()
        assert point is not None and point.step >= 14
        resumed = start(jobs, ["--job", job, "--steps", "30", "--resume", *common], env, b_out,
                        tmp_path / "b.log")
        await finish(resumed, tmp_path / "b.log")
        await c.event(29, "committed")
    reference = {r: losses(ref_out, r) for r in (0, 1)}
    for rank in (0, 1):
        loaded = torch.load(b_out / f"loaded-rank{rank}.pt", weights_only=False)
        assert loaded["step"] == point.step
        saved = torch.load(a_out / f"state-rank{rank}-step{point.step}.pt", weights_only=False)
        assert_same(saved["model"], loaded["model"], "model")
        assert_same(saved["optim"], loaded["optim"], "optim")
        first_run, after = losses(a_out, rank), losses(b_out, rank)
        assert sorted(after) == list(range(point.step + 1, 30))
        # The interrupted run and the resumed one are both the uninterrupted trajectory.
        assert {s: reference[rank][s] for s in first_run if s < 30} == \
            {s: v for s, v in first_run.items() if s < 30}
        assert after == {s: reference[rank][s] for s in after}
    assert reference[0] != reference[1]  # ranks draw different data: per-rank RNG mattered


async def test_a_checkpoint_that_does_not_load_falls_back_and_none_loading_is_no_start(
        nats_url: str, redis_url: str, prefix: str, job: str, tmp_path: Path,
        jobs: list[Job]) -> None:
    root = tmp_path / "ckpt"
    env = job_env(nats_url, prefix)
    common = ["--root", str(root), "--every", "5", "--step-time", "0.02", "--job", job]
    async with coordinator(nats_url, redis_url, prefix, job) as c, \
            tapped(nats_url, prefix, job) as (tap, _):
        first = start(jobs, ["--steps", "100000", *common], env, tmp_path / "a",
                      tmp_path / "a.log")
        await c.event(14, "committed", timeout=90)
        await wait_until(lambda: len(list((tmp_path / "a").glob("pid-rank*"))) == 2,
                         what="worker pids")
        kill(first)
        point = await c.resume()
        assert point is not None and point.step >= 14
        committed = sorted(s for d in (root / job).glob("step-*")
                           if (d / "COMMITTED").exists() and (s := int(d.name[5:])) < point.step)
        (root / job / f"step-{point.step}" / "__1_0.distcp").unlink()  # rank 1's shard gone
        b = start(jobs, ["--steps", str(point.step + 3), "--resume", *common], env,
                  tmp_path / "b", tmp_path / "b.log")
        await finish(b, tmp_path / "b.log")
        loaded = torch.load(tmp_path / "b" / "loaded-rank0.pt", weights_only=False)
        assert loaded["step"] == committed[-1]  # the previous committed one, not step 0
        await wait_until(lambda: tap.of(RecoveryReport), what="the resume report")
        [report] = tap.of(RecoveryReport)
        assert report.kind == "resume" and report.resumed_step == committed[-1] + 1
        assert f"not the newer step {point.step}" in report.reason
        assert report.steps_lost == point.step - committed[-1]
        for shard in (root / job).glob("step-*/__0_0.distcp"):  # nothing loads any more
            shard.unlink()
        log = tmp_path / "c.log"
        proc, _ = start(jobs, ["--steps", "1000", "--resume", *common], env, tmp_path / "c",
                        log)
        code = await asyncio.to_thread(proc.wait, 120)
    assert code != 0
    text = log.read_text()
    assert "NoCheckpointLoads" in text and "refusing to start from step 0" in text
    assert not (tmp_path / "c" / "losses-rank0.txt").exists() or \
        not (tmp_path / "c" / "losses-rank0.txt").read_text().strip()


async def test_save_now_within_deadline_and_a_rank_that_ignores_it(
        nats_url: str, redis_url: str, prefix: str, job: str, tmp_path: Path,
        jobs: list[Job]) -> None:
    root = tmp_path / "ckpt"
    env = job_env(nats_url, prefix)
    ignoring = f"{job}-ig"
    common = ["--root", str(root), "--steps", "100000", "--step-time", "0.02",
              "--sync-every", "5", "--side-timeout", "5"]
    async with coordinator(nats_url, redis_url, prefix, job) as c, \
            tapped(nats_url, prefix, job) as (tap, _), \
            tapped(nats_url, prefix, ignoring) as (tap_ig, _):
        start(jobs, ["--job", job, *common], env, tmp_path / "ok", tmp_path / "ok.log")
        start(jobs, ["--job", ignoring, "--ignore-save-now-rank", "1", *common], env,
              tmp_path / "ig", tmp_path / "ig.log")
        for t in (tap, tap_ig):
            await wait_until(lambda t=t: {r.rank for r in t.of(StepReport)} == {0, 1},
                             timeout=90, what="both ranks training")

        reply = json.loads(await c.rpc("save", {"deadline": 60}, timeout=70))
        assert reply["ok"] and reply["status"] == "committed", reply
        step = reply["step"]
        assert (root / job / f"step-{step}" / ".metadata").exists()
        assert (await c.resume()).step == step  # type: ignore[union-attr]
        assert {a.detail.split()[0] for a in tap.acks} == {f"step={step}"}

        raw = await c.bus.nc.request(c.s.rpc(ignoring, "save"),
                                     json.dumps({"deadline": 60}).encode(), timeout=70)
        failed = json.loads(raw.data)
        assert not failed["ok"] and failed["status"] == "failed", failed
        assert failed["missing_ranks"] == [1] and failed["failed_ranks"] == [0]
        assert "rank 0:" in failed["reason"] and "no report from ranks [1]" in failed["reason"]
        assert not (root / ignoring / "LATEST").exists()
