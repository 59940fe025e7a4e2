"""The toy trainer's sharded modes without trainguard (``TRAINGUARD_DISABLED=1``), as the
recovery benchmark's baselines run them: 4 gloo ranks under torchrun, the tiny model
sharded with FSDP2 (``--parallel fsdp``, a 1-D mesh) or HSDP (``--parallel hsdp``, a 2x2
``(replicate, shard)`` mesh), AdamW (sharded optimizer state).

A run that crashes (``--raise-at``) and is restarted by torchrun (``--max-restarts 1``)
resumes from its DCP ``--plain-ckpt`` (the step directory named in ``latest``) and ends
with the full parameters (``--final-params``, gathered from the shards) of a run that never
crashed, bit for bit: the baseline's checkpoint holds model and optimizer shards and the
step, and the data depends only on (seed, rank, step).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from trainguard.runtime.embedded import free_port

NPROC = 4
STEPS = 20
CKPT_EVERY = 5
CRASH = "1:12"
"""Rank 1 raises at step 12, after the saves at steps 4 and 9: the restart resumes at 10
(and saves at 14 and 19)."""
WAIT = 150.0


def baseline_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env.update({"TRAINGUARD_DISABLED": "1", "GLOO_SOCKET_IFNAME": "lo",
                "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                # torchrun's restart on gloo needs its own store (pytorch/pytorch#135712)
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    return env


def start(procs: list[subprocess.Popen[bytes]], trainer: Sequence[str], log: Path,
          max_restarts: int = 0) -> subprocess.Popen[bytes]:
    """A single-node torchrun job of the toy trainer (c10d rendezvous on loopback)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
           "--nproc-per-node", str(NPROC), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", log.stem,
           "--local-addr", "127.0.0.1", "--max-restarts", str(max_restarts),
           "-m", "trainguard.examples.toy_trainer", *trainer]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, env=baseline_env(), stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    procs.append(proc)
    return proc


def finished(proc: subprocess.Popen[bytes], log: Path) -> str:
    try:
        code = proc.wait(WAIT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{log.name}: still running after {WAIT:.0f} s\n"
                    f"{log.read_text(errors='replace')[-4000:]}")
    text = log.read_text(errors="replace")
    assert code == 0, f"{log.name} exited {code}\n{text[-4000:]}"
    return text


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert set(a) == set(b)
    for k in a:
        assert isinstance(a[k], torch.Tensor) and not hasattr(a[k], "placements"), k
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        same = torch.equal(a[k], b[k])
        assert same, f"{k}: max |difference| {(a[k] - b[k]).abs().max().item():.3g}"


@pytest.mark.parametrize("parallel", ["fsdp", "hsdp"])
def test_sharded_baseline_resumes_from_its_dcp_checkpoint_bit_for_bit(
        parallel: str, tmp_path: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    common = ["--job", f"sharded-{parallel}", "--model", "tiny", "--steps", str(STEPS),
              "--step-time", "0", "--parallel", parallel, "--optimizer", "adamw",
              "--seed", "5", "--pg-timeout", "30"]
    ckpt, progress = tmp_path / "ckpt", tmp_path / "progress"
    # Both jobs at once: on two cores that is quicker than one after the other.
    clean = start(procs, [*common, "--final-params", str(tmp_path / "clean.pt")],
                  tmp_path / "clean.log")
    crashed = start(procs, [*common, "--final-params", str(tmp_path / "crashed.pt"),
                            "--plain-ckpt", str(ckpt), "--ckpt-every", str(CKPT_EVERY),
                            "--raise-at", CRASH, "--progress-file", str(progress)],
                    tmp_path / "crashed.log", max_restarts=1)
    finished(clean, tmp_path / "clean.log")
    log = finished(crashed, tmp_path / "crashed.log")

    # The crash fired once, on the first attempt, and the restart resumed from step 9.
    lines = [line.split() for line in progress.read_text().splitlines()]
    faults = [f for f in lines if any(x.startswith("fault=") for x in f)]
    assert [(int(f[1]), int(f[2]), f[4]) for f in faults] == [(12, 0, "fault=crash")]
    steps = [(int(f[1]), int(f[2])) for f in lines if f not in faults]
    before = [s for s, a in steps if a == 0]
    assert before == list(range(len(before))) and len(before) >= 10  # 12 unless killed early
    assert [s for s, a in steps if a == 1] == list(range(10, STEPS))
    assert log.count("resumed from step 9 (") == NPROC, log[-4000:]
    assert (ckpt / "latest").read_text().strip() == "step-19"
    assert {p.name for p in ckpt.glob("step-*")} == {"step-14", "step-19"}  # older pruned

    clean_params = torch.load(tmp_path / "clean.pt", weights_only=True)
    crashed_params = torch.load(tmp_path / "crashed.pt", weights_only=True)
    # The full (gathered) parameters: the embedding is 64x32 whole, not one rank's shard.
    assert clean_params["embed.weight"].shape == (64, 32)
    assert_same(clean_params, crashed_params)
