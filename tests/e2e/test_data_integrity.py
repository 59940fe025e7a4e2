"""Data integrity end to end: the toy trainer's numbered samples (``--loader stateful``: a
``StatefulDataLoader`` read through ``trainguard.torch.Batches``, each batch checked by
``BatchCheck``) under two ``trainguard launch`` agents and the control plane, 4 gloo ranks.

* A NaN in one rank's batch is caught on that rank before the forward pass; every rank
  skips the step, the incident says ``data_pipeline`` and names the rank and the sample,
  nothing is rolled back, and the job ends with the parameters of a run that never
  trained on that batch.
* A killed rank replaced in place, a group restarted from the committed checkpoint, and a
  NaN rolled back from memory snapshots: each rank trains on the same samples in the same
  order as an uninterrupted run, every sample once per epoch, and the loss curve is the
  same bit for bit (CPU).
* Under plain torchrun: data that no longer matches its manifest is refused at the start,
  on every rank; ``trainguard runs show`` reads a real run's record.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from tests.conftest import wait_until
from tests.e2e.conftest import job_env, torchrun
from tests.e2e.test_in_place import (
    OFTEN_SYNC,
    InPlaceCluster,
    running,
    survivors_kept,
    uninterrupted,
)
from trainguard.contract.evidence import BadBatchEvidence
from trainguard.examples.samples import BATCH, SAMPLES

pytestmark = pytest.mark.timeout(480)
BAD_STEP = 30
Line = tuple[int, int, str, str]
"""(rank, step, loss or ``skipped``, sample ids) of one step a rank completed."""


def read_samples(path: Path) -> list[Line]:
    lines = []
    for raw in path.read_text().splitlines():
        rank, step, _attempt, _pid, loss, *ids = raw.split(" ")
        lines.append((int(rank), int(step), loss, ids[0] if ids else ""))
    return lines


def trained(lines: list[Line]) -> dict[tuple[int, int], tuple[str, str]]:
    """What each rank's step finally trained on: a step run again after a restart or a
    rollback replaces the earlier run's (the state went back to before it)."""
    return {(rank, step): (loss, ids) for rank, step, loss, ids in lines}


def each_sample_once_per_epoch(final: dict[tuple[int, int], tuple[str, str]]) -> None:
    per_epoch = SAMPLES // (4 * BATCH)
    epochs: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for (_rank, step), (_loss, ids) in final.items():
        if ids:
            epochs[step // per_epoch].update(int(i) for i in ids.split(","))
    full = [e for e in epochs if (e + 1) * per_epoch <= max(s for _, s in final) + 1]
    assert full, "the run covers at least one epoch"
    for e in full:
        assert epochs[e] == collections.Counter(range(SAMPLES)), f"epoch {e}"


@pytest.fixture
async def cluster(tmp_path: Path, job: str, request: pytest.FixtureRequest
                  ) -> AsyncIterator[InPlaceCluster]:
    bad = ["--bad-batch-at", f"2:{BAD_STEP}"] if "nan_batch" in request.node.name else []
    c = InPlaceCluster(tmp_path, job, ["--loader", "stateful", "--samples-file",
                                       str(tmp_path / "samples.txt"), *OFTEN_SYNC, *bad])
    async with running(c):
        yield c


def baseline(tmp_path: Path, nats_url: str, prefix: str, *extra: str
             ) -> tuple[dict[str, torch.Tensor], dict[tuple[int, int], tuple[str, str]]]:
    """An uninterrupted run of the same trainer: its parameters and what each step trained
    on."""
    path = tmp_path / "baseline-samples.txt"
    params = uninterrupted(tmp_path, nats_url, prefix, ["--loader", "stateful",
                                                       "--samples-file", str(path), *extra])
    lines = read_samples(path)
    assert len(lines) == len(trained(lines)), "an uninterrupted run runs each step once"
    return params, trained(lines)


def same_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    assert {k: (got[k] - v).abs().max().item() for k, v in want.items()
            if not torch.equal(got[k], v)} == {}, "parameters differ"


async def test_a_nan_batch_is_caught_on_its_rank_and_skipped_by_every_rank(
        cluster: InPlaceCluster, tmp_path: Path, nats_url: str, prefix: str) -> None:
    c = cluster
    await c.finished()
    inc = await wait_until(lambda: c.incident(lambda i: i.cause == "data_pipeline"),
                           timeout=60, interval=0.5, what="the bad batch's incident")
    assert inc.ranks == [2] and inc.hosts == ["node-b"], inc
    assert not any(a.action in ("rollback", "restart", "isolate") for a in inc.actions), \
        inc.actions
    [bad] = [a for a in c.observer.anomalies if a.kind == "bad_batch"][:1]
    assert bad.step == BAD_STEP and isinstance(bad.evidence, BadBatchEvidence)
    fault = bad.evidence.faults["2"]
    assert (fault.kind, fault.key, fault.sample, fault.source) == \
        ("nonfinite", "weight", 3, "numbered-samples"), fault
    assert fault.sample_id.isdigit() and bad.evidence.skipped
    assert not any(a.kind == "nonfinite" for a in c.observer.anomalies), c.story()
    survivors_kept(c, set())

    lines = read_samples(tmp_path / "samples.txt")
    at_bad = [(rank, loss) for rank, step, loss, _ in lines if step == BAD_STEP]
    assert sorted(at_bad) == [(r, "skipped") for r in range(4)], "every rank skipped it"
    want_params, want = baseline(tmp_path, nats_url, prefix, "--exclude-step", str(BAD_STEP))
    got = {k: v for k, v in trained(lines).items() if k[1] != BAD_STEP}
    assert got == want, "the same samples and losses as a run that never trained on it"
    same_params(torch.load(c.final, weights_only=True), want_params)


@pytest.mark.parametrize("fault", ["replaced", "restarted", "rolled_back"])
async def test_every_sample_once_and_the_same_loss_curve_after_a_fault(
        cluster: InPlaceCluster, tmp_path: Path, nats_url: str, prefix: str,
        fault: str) -> None:
    c = cluster
    await wait_until(lambda: any(k.status == "committed" for k in c.observer.checkpoints),
                     timeout=90, what="a committed checkpoint")
    if fault == "replaced":
        await c.drill("kill", 2)
    elif fault == "restarted":
        await c.drill("kill", [2, 3])
    else:
        await c.drill("nan", 0)
    inc = await wait_until(lambda: c.incident(lambda i: i.status == "resolved"),
                           timeout=150, interval=0.5, what="the incident resolved")
    await c.finished()
    assert inc.recovery is not None, inc
    path = {"replaced": "in_place", "restarted": "restart", "rolled_back": "in_place"}[fault]
    assert inc.recovery.path == path, inc.recovery
    if fault == "rolled_back":
        assert inc.recovery.tier == "memory", inc.recovery

    lines = read_samples(tmp_path / "samples.txt")
    final = trained(lines)
    if fault == "replaced":  # nothing went back: no step of any rank ran twice
        assert len(lines) == len(final), collections.Counter((r, s) for r, s, *_ in lines)
    elif fault == "rolled_back":
        assert len(lines) > len(final), "steps after the restored state ran again"
    # A restart may lose nothing: ranks killed right after the checkpoint of the step every
    # rank completed last resume at the next one, and no step runs twice.
    want_params, want = baseline(tmp_path, nats_url, prefix)
    assert sorted(final) == sorted(want), "every rank ran every step"
    differ = [(k, final[k], want[k]) for k in sorted(want) if final[k] != want[k]]
    assert differ == [], f"{len(differ)} steps trained on other samples or lost bits"
    each_sample_once_per_epoch(final)
    same_params(torch.load(c.final, weights_only=True), want_params)


def test_changed_data_is_refused_and_runs_show_reads_the_record(
        tmp_path: Path, nats_url: str, prefix: str) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for i in range(3):
        (data / f"shard-{i}.bin").write_bytes(bytes([i]) * 4096)
    manifest = tmp_path / "manifest.json"
    made = subprocess.run([sys.executable, "-m", "trainguard", "data", "manifest", str(data),
                           "-o", str(manifest)], capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    root = tmp_path / "ckpt"
    args = ["--job", "manifested", "--model", "tiny", "--steps", "12", "--step-time", "0",
            "--ckpt-root", str(root), "--ckpt-every", "5", "--manifest", str(manifest)]
    env = job_env(nats_url, prefix)
    first = torchrun(2, args, env, tmp_path / "first.log")
    assert first.wait(120) == 0, (tmp_path / "first.log").read_text()[-3000:]

    shown = subprocess.run([sys.executable, "-m", "trainguard", "runs", "show", "manifested",
                            "--root", str(root), "--json"], capture_output=True, text=True,
                           timeout=60)
    assert shown.returncode == 0, shown.stderr
    record = json.loads(shown.stdout)
    assert record["hardware"]["torch"] == torch.__version__, record["hardware"]
    assert record["manifest_id"] == json.loads(manifest.read_text())["id"]
    assert record["config"]["steps"] == 12 and record["job"] == "manifested"
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=Path.cwd(), timeout=10)
    if head.returncode == 0:  # run from a checkout, as CI's clean clone is
        assert record["git"]["revision"] == head.stdout.strip(), record["git"]

    (data / "shard-1.bin").write_bytes(b"\x07" * 4000)  # changed and shorter
    second = torchrun(2, args, env, tmp_path / "second.log")
    assert second.wait(120) != 0
    log = (tmp_path / "second.log").read_text()
    assert "shard-1.bin" in log and "DataMismatch" in log, log[-3000:]
    assert "finished" not in log, "no rank trained on the changed data"
