"""Sharded checkpoints through ``trainguard.torch.Checkpointer``, resharded on load.

Real gloo jobs under torchrun (``tests.e2e.shard_trainer``), each rank with a real Guard on
the test's bus. A job trains a few steps in one layout and world size and saves; another
loads that checkpoint in another (or the same) layout and size. Each gathers the full
model and AdamW state (``full_state_dict=True``) on rank 0, and the loaded state must be
the saved one bit for bit: the same keys, and ``torch.equal`` on every parameter,
``exp_avg``, ``exp_avg_sq`` and ``step``.

* FSDP2 saved at 4 ranks loads at 8 (uneven and empty shards), at 2, and as DDP at 2;
  saved at 2, it loads at 4.
* HSDP on a 2x2 mesh loads as FSDP2 at 2 ranks.
* FSDP2 + tensor parallel on a 2x2 ("dp", "tp") mesh loads in the same layout, at tp=4
  (1x4), and as FSDP2 without TP at 2 ranks.
* DDP saved at 2 loads as FSDP2 at 4.

The jobs of a test run one after another (two CPU cores), grouped so that a test takes
about a minute at most; an 8-rank job is most of its test's time (each rank imports torch).

Each rank's RNG state travels under its own key: a rank of the loading world that was in
the saving world gets its state back; one that was not keeps its own.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from tests.e2e.conftest import job_env, torchrun
from trainguard.contract.schemas import CheckpointReport

TRAINER = "tests.e2e.shard_trainer"
STEPS = 3
SAVED_STEP = STEPS - 1
JOB_TIMEOUT = 120
REPO = Path(__file__).parents[2]


@dataclass
class Saved:
    out: Path
    world: int
    path: Path
    state: dict[str, Any] = field(repr=False)


@dataclass
class Jobs:
    """Runs this test's jobs, one after another, all under one job name and root (a
    Checkpointer loads only from its own ``<root>/<job>``)."""

    procs: list[Any]
    tmp: Path
    env: dict[str, str]
    job: str

    @property
    def root(self) -> Path:
        return self.tmp / "ckpt"

    def run(self, name: str, nproc: int, mode: str, phase: str, *args: str) -> Path:
        out, log = self.tmp / name, self.tmp / f"{name}.log"
        proc = torchrun(nproc, ["--job", self.job, "--root", str(self.root), "--out", str(out),
                                "--mode", mode, "--phase", phase, "--steps", str(STEPS),
                                *args], self.env, log, module=TRAINER)
        self.procs.append(proc)
        code = proc.wait(JOB_TIMEOUT)
        assert code == 0, f"{name}: exit {code}\n{log.read_text()[-6000:]}"
        return out

    def save(self, name: str, nproc: int, mode: str, *args: str) -> Saved:
        out = self.run(name, nproc, mode, "save", *args)
        path = self.root / self.job / f"step-{SAVED_STEP}"
        state = torch.load(out / "saved.pt", weights_only=True)
        assert (state["step"], state["world"]) == (SAVED_STEP, nproc)
        assert_trained(state)
        assert_reports(out, path, nproc)
        return Saved(out, nproc, path, state)

    def load(self, saved: Saved, name: str, nproc: int, mode: str, *args: str) -> None:
        out = self.run(name, nproc, mode, "load", "--path", str(saved.path), *args)
        loaded = torch.load(out / "loaded.pt", weights_only=True)
        assert (loaded["step"], loaded["world"], loaded["mode"]) == (SAVED_STEP, nproc, mode)
        assert_identical(saved.state["model"], loaded["model"], "model")
        assert_identical(saved.state["optim"], loaded["optim"], "optim")
        assert_rng(saved, out, nproc)


@pytest.fixture
def jobs(nats_url: str, prefix: str, job: str, tmp_path: Path,
         procs: list[Any]) -> Iterator[Jobs]:
    env = job_env(nats_url, prefix)
    # The workers import the trainer from this checkout, wherever pytest was started.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    yield Jobs(procs, tmp_path, env, job)


def assert_identical(a: Any, b: Any, where: str) -> None:
    """Exact equality: the same keys, types, dtypes, shapes, and every tensor bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: {type(b).__name__}, not a tensor"
        assert (a.dtype, a.shape) == (b.dtype, b.shape), \
            f"{where}: {a.dtype}{list(a.shape)} saved, {b.dtype}{list(b.shape)} loaded"
        assert torch.equal(a, b), f"{where}: values differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict), f"{where}: {type(b).__name__}, not a dict"
        assert set(a) == set(b), f"{where}: keys {sorted(map(str, set(a) ^ set(b)))} differ"
        for k in a:
            assert_identical(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {a!r} != {b!r}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_trained(state: dict[str, Any]) -> None:
    """The reference has what the comparison is about: AdamW state for every parameter,
    after STEPS steps."""
    model, optim = state["model"], state["optim"]
    assert set(model) == set(optim["state"]) and len(model) == 10, sorted(model)
    for fqn, s in optim["state"].items():
        assert set(s) == {"step", "exp_avg", "exp_avg_sq"}, (fqn, sorted(s))
        assert s["step"].item() == STEPS, fqn
        assert s["exp_avg"].shape == model[fqn].shape and s["exp_avg_sq"].abs().sum() > 0, fqn
    assert [sorted(g["params"]) for g in optim["param_groups"]] == [sorted(model)]


def assert_reports(out: Path, path: Path, world: int) -> None:
    """Every rank reported its save, and the reports' files are the checkpoint's, with
    their sizes and CRC32s."""
    files: dict[str, Any] = {}
    for rank in range(world):
        report = msgspec.json.decode((out / f"report-rank{rank}.json").read_bytes(),
                                     type=CheckpointReport)
        assert report.ok, report.error
        assert (report.rank, report.step, report.world_size) == (rank, SAVED_STEP, world)
        assert Path(report.path) == path
        assert not set(files) & set(report.files)
        files |= report.files
    assert set(files) == set(os.listdir(path)), sorted(os.listdir(path))
    for name, digest in files.items():
        data = (path / name).read_bytes()
        assert (digest.bytes, digest.crc32) == (len(data), zlib.crc32(data)), name


def assert_rng(saved: Saved, out: Path, world: int) -> None:
    """A loading rank that was in the saving world has that rank's RNG state back; one
    that was not keeps the state it had."""
    before = {r: torch.load(saved.out / f"rng-rank{r}.pt") for r in range(saved.world)}
    assert len({bytes(t.numpy()) for t in before.values()}) == saved.world  # per rank
    for rank in range(world):
        after = torch.load(out / f"rng-rank{rank}.pt")
        expected = before[rank] if rank < saved.world else \
            torch.load(out / f"rng-before-rank{rank}.pt")
        assert torch.equal(after, expected), f"rank {rank}: RNG state"


def test_fsdp_saved_at_4_loads_at_8(jobs: Jobs) -> None:
    saved = jobs.save("save-fsdp4", 4, "fsdp")
    jobs.load(saved, "load-fsdp8", 8, "fsdp")


def test_fsdp_saved_at_4_loads_at_2_and_as_ddp(jobs: Jobs) -> None:
    saved = jobs.save("save-fsdp4", 4, "fsdp")
    jobs.load(saved, "load-fsdp2", 2, "fsdp")
    jobs.load(saved, "load-ddp2", 2, "ddp")


def test_fsdp_saved_at_2_loads_at_4(jobs: Jobs) -> None:
    saved = jobs.save("save-fsdp2", 2, "fsdp")
    jobs.load(saved, "load-fsdp4", 4, "fsdp")


def test_hsdp_2x2_loads_as_fsdp_at_2(jobs: Jobs) -> None:
    saved = jobs.save("save-hsdp", 4, "hsdp", "--replicate", "2")
    jobs.load(saved, "load-fsdp2", 2, "fsdp")


def test_tp_2x2_loads_in_the_same_layout_and_others(jobs: Jobs) -> None:
    saved = jobs.save("save-tp", 4, "tp", "--tp", "2")
    jobs.load(saved, "load-tp-2x2", 4, "tp", "--tp", "2")
    jobs.load(saved, "load-tp-1x4", 4, "tp", "--tp", "4")
    jobs.load(saved, "load-fsdp2", 2, "fsdp")


def test_ddp_saved_at_2_loads_as_fsdp_at_4(jobs: Jobs) -> None:
    saved = jobs.save("save-ddp", 2, "ddp")
    jobs.load(saved, "load-fsdp4", 4, "fsdp")
