"""The node-local collective bandwidth test: an all-reduce among the node's devices.

NCCL over the node's GPUs (NVLink or PCIe between them), gloo over loopback where there
are none; skipped where torch is not installed. The ranks are processes of their own
(:mod:`.allreduce`), meeting through a file store in a temporary directory, so the test
needs no port and leaves nothing behind; the caller holds the result against a floor.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class BandwidthResult:
    busbw_gbps: float = 0.0
    backend: str = ""
    ranks: int = 0
    seconds: float = 0.0
    exact: bool = True
    skipped: str = ""
    error: str = ""


def torch_missing() -> str:
    """Why the test cannot run here ("": it can)."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed (pip install 'trainguard[torch]')"
    return ""


def measure(*, gpus: int, procs: int, megabytes: float, iters: int,
            timeout: float) -> BandwidthResult:
    """All-reduce bus bandwidth among ``procs`` ranks (0: one per GPU; without GPUs that
    is none, and the test is skipped: asked for, it runs gloo over loopback)."""
    if gpus == 0 and procs == 0:
        return BandwidthResult(skipped="no GPU on this node (set preflight_allreduce_procs "
                               "to test gloo over loopback)")
    why = torch_missing()
    if why:
        return BandwidthResult(skipped=why)
    backend = "nccl" if gpus > 0 else "gloo"
    world = procs or gpus
    if backend == "nccl" and world > gpus:
        return BandwidthResult(error=f"{world} ranks asked for but only {gpus} GPU(s)")
    if world < 2:
        return BandwidthResult(skipped="one device: nothing to all-reduce with")
    env = dict(os.environ)
    if backend == "gloo":
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="trainguard-allreduce-") as tmp:
        init = f"file://{os.path.join(tmp, 'store')}"
        cmds = [[sys.executable, "-m", "trainguard.health.allreduce", "--rank", str(r),
                 "--world", str(world), "--init", init, "--backend", backend,
                 "--mb", str(megabytes), "--iters", str(iters), "--timeout", str(timeout)]
                for r in range(world)]
        ranks = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env) for c in cmds]
        outputs: list[tuple[str, str]] = []
        try:
            for r in ranks:
                left = max(0.1, timeout - (time.monotonic() - start))
                outputs.append(r.communicate(timeout=left))
        except subprocess.TimeoutExpired:
            for r in ranks:
                r.kill()
                r.wait()
            return BandwidthResult(backend=backend, ranks=world,
                                   error=f"the all-reduce ran past {timeout:g} s")
    failed = [(i, r.returncode, outputs[i][1]) for i, r in enumerate(ranks)
              if r.returncode not in (0, 3)]
    if failed:
        i, code, err = failed[0]
        tail = err.strip().splitlines()[-1][:200] if err.strip() else ""
        return BandwidthResult(backend=backend, ranks=world,
                               error=f"rank {i} exited {code}: {tail}")
    try:
        line = outputs[0][0].strip().splitlines()[-1]
        got = json.loads(line)
    except (IndexError, ValueError):
        return BandwidthResult(backend=backend, ranks=world,
                               error=f"rank 0 printed no result: {outputs[0][0][-200:]!r}")
    return BandwidthResult(busbw_gbps=float(got["busbw_gbps"]), backend=backend, ranks=world,
                           seconds=round(time.monotonic() - start, 2),
                           exact=bool(got["exact"]))
