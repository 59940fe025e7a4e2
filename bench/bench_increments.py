"""Incremental checkpoints against full ones: bytes written, save time, restore time.

Two models, each saved by a full-only Checkpointer and by ``Checkpointer(incremental=4)``
in the same run, in one process (no process group), on the CPU:

* ``adapter``: a frozen base (~90% of the parameters) under a trained adapter; AdamW holds
  state for the adapter only. An increment writes the adapter and its optimizer state.
* ``trained``: every parameter trained. An increment finds every tensor changed and writes
  all of it: what turning increments on costs where they cannot help (the hashing).

Per model and mode: a first full save (the chain's base), then ``--saves`` saves one
training step apart (blocking, so ``save_s`` is the whole save: hashing, DCP's write, the
checksums), medians. ``bytes`` is what those saves wrote (DCP's files plus ``INCREMENT``).
Restore: a fresh model loads the last step by its resume point, with the commit record the
coordinator would have written (so the load verifies every file it reads): the full
checkpoint against the chain (the increment and its base). ``hash_s``: hashing every
tensor of the state once (what an incremental save adds to the loop). Files go to ``--root``
(default: a temporary directory), so reads may come from the page cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainguard import Guard
from trainguard.contract.commit_record import COMMIT_FILE, CommitRecord, encode_commit
from trainguard.contract.schemas import CheckpointReport, ResumePoint
from trainguard.runtime.embedded import free_port
from trainguard.torch import Checkpointer
from trainguard.torch.increments import digests

WIDTH = 2048


def make(kind: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``adapter``: 5 frozen square layers and a trained bottleneck adapter (~9% of the
    parameters); ``trained``: the same layers, all trained."""
    torch.manual_seed(0)
    base = [nn.Linear(WIDTH, WIDTH) for _ in range(5)]
    adapter = [nn.Linear(WIDTH, 256), nn.Linear(256, WIDTH)]
    model = nn.Sequential(*base, *adapter)
    if kind == "adapter":
        for layer in base:
            layer.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return model, opt


def train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, WIDTH)).pow(2).mean().backward()  # type: ignore[no-untyped-call]
    opt.step()
    opt.zero_grad()


def commit(report: CheckpointReport, base_id: str) -> None:
    """The commit record the coordinator writes (a resume point loads only with one)."""
    record = CommitRecord(job=report.job, step=report.step, path=report.path,
                          checkpoint_id=report.id, world_size=1, files=report.files,
                          base=report.base, base_id=base_id if report.base is not None else "")
    (Path(report.path) / COMMIT_FILE).write_bytes(encode_commit(record))


def run(kind: str, incremental: int, root: Path, saves: int, loads: int) -> dict[str, Any]:
    guard = Guard(job=f"bench-{kind}-{incremental}", rank=0, world_size=1, host="bench",
                  nats_url=f"nats://127.0.0.1:{free_port()}", heartbeat_interval=60)
    model, opt = make(kind)
    ckpt = Checkpointer(guard, root, incremental=incremental, memory=None)
    train(model, opt)
    ckpt.save(0, model, opt, blocking=True)  # the base, and a warm-up for both modes
    ids = {0: ckpt.reports[-1].id}
    times, written = [], 0
    for step in range(1, saves + 1):
        train(model, opt)
        t0 = time.perf_counter()
        ckpt.save(step, model, opt, blocking=True)
        times.append(time.perf_counter() - t0)
        report = ckpt.reports[-1]
        assert report.ok, report.error
        ids[step] = report.id
        written += sum(d.bytes for n, d in report.files.items() if n != "run.json")
    for report in ckpt.reports:
        commit(report, ids[report.base] if report.base is not None else "")
    last = ckpt.reports[-1]
    restores = []
    for _ in range(loads):
        fresh, fresh_opt = make(kind)
        reader = Checkpointer(guard, root, memory=None)
        point = ResumePoint(job=last.job, step=last.step, path=last.path, world_size=1)
        t0 = time.perf_counter()
        assert reader.load(point, fresh, fresh_opt) == last.step
        restores.append(time.perf_counter() - t0)
        reader.close()
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    ckpt.close()
    guard.close(timeout=0.1)
    from torch.distributed.checkpoint.state_dict import get_state_dict

    state = dict(zip(("model", "optim"), get_state_dict(model, opt), strict=True))
    hashing = []
    for _ in range(3):
        t0 = time.perf_counter()
        digests(state)
        hashing.append(time.perf_counter() - t0)
    params = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"params": params, "trained": trained, "saves": saves,
            "kinds": ["full" if r.base is None else f"incr of {r.base}" for r in ckpt.reports],
            "bytes_per_save": written // saves, "save_s": statistics.median(times),
            "save_all": times, "restore_s": statistics.median(restores),
            "restore_all": restores, "hash_s": min(hashing)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--loads", type=int, default=3)
    ap.add_argument("--root", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(dir=args.root) as tmp:
        for kind in ("adapter", "trained"):
            for incremental in (0, 4):
                mode = "incremental" if incremental else "full"
                results[f"{kind}/{mode}"] = run(kind, incremental, Path(tmp) / kind / mode,
                                                args.saves, args.loads)
                r = results[f"{kind}/{mode}"]
                print(f"{kind:8s} {mode:12s} {r['bytes_per_save'] / 1e6:8.1f} MB/save "
                      f"save {r['save_s']:.3f}s (hashing {r['hash_s']:.3f}s) "
                      f"restore {r['restore_s']:.3f}s "
                      f"({', '.join(r['kinds'])})", flush=True)
    text = json.dumps(results, indent=2)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
