"""Checkpoint cost: the training loop's stall per save, and the coordinator's commit latency.

1. Loop stall: ``Checkpointer.save`` of a ~100M-parameter model with AdamW state (~1.2 GB)
   on the CPU, in a gloo world of 1, asynchronous (``dcp.async_save``: the loop pays the
   staging copy into a cached CPU buffer) vs synchronous (the loop pays the whole write,
   fsync included), medians after one warm-up save per mode. ``total`` is when the files
   are written and checksummed (what ranks report as ``seconds_total``).
2. Commit latency: time from publishing the last rank's ``CheckpointReport`` to the
   ``CheckpointCommitted`` event, with a coordinator running against an embedded control
   plane: small 4-rank checkpoints (``verify=size``), and the real 1.2 GB checkpoint of
   part 1 with ``verify=size`` and ``verify=full`` (a CRC32 re-read of every byte).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import torch
import torch.distributed as dist
from torch import nn

from trainguard import Guard
from trainguard.contract.codec import decode_durable
from trainguard.contract.envelope import uuid7
from trainguard.contract.schemas import CheckpointCommitted, CheckpointReport, FileDigest
from trainguard.contract.subjects import Subjects
from trainguard.runtime.bus import Bus
from trainguard.runtime.config import load_settings
from trainguard.runtime.embedded import EmbeddedControlPlane, free_port
from trainguard.runtime.service import run_service
from trainguard.services.checkpointer.service import CheckpointerService
from trainguard.services.checkpointer.settings import CheckpointerSettings
from trainguard.torch import Checkpointer

PREFIX = "bench"


def model_of(params: int) -> nn.Module:
    """A stack of square linear layers with about ``params`` parameters."""
    width = 3200
    layers = max(1, round(params / (width * width + width)))
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def bench_stall(url: str, root: Path, params: int, reps: int) -> dict[str, Any]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    torch.manual_seed(0)
    model = model_of(params)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, 3200)).sum().backward()  # type: ignore[no-untyped-call]
    opt.step()  # Adam moments exist: the checkpoint holds ~3x the parameters
    guard = Guard(job="bench-ckpt", rank=0, world_size=1, host="bench", nats_url=url,
                  heartbeat_interval=5.0)
    results: dict[str, Any] = {"params": n_params}
    last: CheckpointReport | None = None
    step = 0
    for mode in ("async", "sync"):
        ckpt = Checkpointer(guard, root, use_async=mode == "async")
        blocked, total = [], []
        for i in range(reps + 1):  # the first save of each mode warms up (allocations)
            step += 1
            t0 = time.perf_counter()
            ckpt.save(step, model, opt)
            stall = time.perf_counter() - t0
            report = ckpt.wait()
            assert report is not None and report.ok, report
            if i > 0:
                blocked.append(stall)
                total.append(report.seconds_total)
            if last is not None:
                shutil.rmtree(last.path, ignore_errors=True)
            last = report
        ckpt.close()
        results[mode] = {"blocked_s": statistics.median(blocked),
                         "total_s": statistics.median(total),
                         "blocked_all": blocked, "total_all": total}
    assert last is not None
    results["bytes"] = last.bytes
    results["report"] = json.loads(json.dumps({"path": last.path, "files": {
        k: {"bytes": v.bytes, "crc32": v.crc32} for k, v in last.files.items()}}))
    guard.close()
    dist.destroy_process_group()
    return results


@contextlib.asynccontextmanager
async def coordinator(plane: EmbeddedControlPlane, verify: str) -> AsyncIterator[None]:
    settings = load_settings(CheckpointerSettings, env={}, overrides={
        "nats_url": plane.nats.url, "redis_url": plane.redis.url, "prefix": PREFIX,
        "verify": verify, "log_level": "WARNING"})
    stop = asyncio.Event()
    ready: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(run_service(CheckpointerService(settings), stop,
                                           install_signals=False, started=ready.set_result))
    await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        task.result()
    try:
        yield
    finally:
        stop.set()
        await task


async def commit_latency(plane: EmbeddedControlPlane, job: str,
                         checkpoints: list[dict[int, CheckpointReport]],
                         verify: str) -> list[float]:
    """Publish each checkpoint's reports; time the last one to its commit event."""
    nc = await nats.connect(plane.nats.url)
    s = Subjects(PREFIX)
    bus = Bus(nc, s, source="bench")
    events: asyncio.Queue[CheckpointCommitted] = asyncio.Queue()

    async def on_event(msg: Any) -> None:
        await events.put(decode_durable(msg.data, CheckpointCommitted))

    await nc.subscribe(s.event(job, "checkpoint"), cb=on_event)
    await nc.flush()
    latencies = []
    async with coordinator(plane, verify):
        for reports in checkpoints:
            *first, final = reports.values()
            for rep in first:
                await bus.publish_durable(s.ckpt(job, rep.rank), rep)
            t0 = time.perf_counter()
            await bus.publish_durable(s.ckpt(job, final.rank), final)
            event = await asyncio.wait_for(events.get(), 600)
            latencies.append(time.perf_counter() - t0)
            assert event.status == "committed", event
    await nc.close()
    return latencies


def small_checkpoints(root: Path, job: str, n: int,
                      world: int) -> list[dict[int, CheckpointReport]]:
    out = []
    for step in range(1, n + 1):
        path = root / job / f"step-{step}"
        path.mkdir(parents=True)
        reports = {}
        for rank in range(world):
            names = [f"__{rank}_0.distcp"] + ([".metadata"] if rank == 0 else [])
            files = {}
            for name in names:
                (path / name).write_bytes(b"x" * 65536)
                files[name] = FileDigest(bytes=65536, crc32=None)
            reports[rank] = CheckpointReport(id=uuid7(), job=job, rank=rank, step=step,
                                             path=str(path), world_size=world, files=files,
                                             time=time.time())
        out.append(reports)
    return out


def real_checkpoint(job: str, report: dict[str, Any], step: int) -> dict[int, CheckpointReport]:
    """The Checkpointer's report of part 1, re-published under a bench job name."""
    src = Path(report["path"])
    dest = src.parent.parent / job / f"step-{step}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    if not dest.exists():
        src.rename(dest)
    files = {k: FileDigest(bytes=v["bytes"], crc32=v["crc32"]) for k, v in report["files"].items()}
    return {0: CheckpointReport(id=uuid7(), job=job, rank=0, step=step, path=str(dest),
                                world_size=1, files=files, time=time.time())}


async def bench_commit(plane: EmbeddedControlPlane, root: Path, report: dict[str, Any],
                       reps: int) -> dict[str, Any]:
    small = await commit_latency(plane, "bench-small", small_checkpoints(root, "bench-small",
                                                                         reps, 4), "size")
    size = await commit_latency(plane, "bench-real-size", [real_checkpoint("bench-real-size",
                                                                           report, 1)], "size")
    moved = {"path": str(root / "bench-real-size" / "step-1"), "files": report["files"]}
    full = await commit_latency(plane, "bench-real-full", [real_checkpoint("bench-real-full",
                                                                           moved, 1)], "full")
    return {"small_4rank_size_ms": {"median": statistics.median(small) * 1e3,
                                    "p95": sorted(small)[int(0.95 * (len(small) - 1))] * 1e3,
                                    "n": len(small)},
            "real_size_ms": size[0] * 1e3, "real_full_ms": full[0] * 1e3}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=int, default=100_000_000)
    p.add_argument("--reps", type=int, default=3, help="saves per mode (default 3)")
    p.add_argument("--commits", type=int, default=30, help="small commits timed (default 30)")
    p.add_argument("--out", help="write results as JSON here")
    args = p.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp, EmbeddedControlPlane(Path(tmp) / "plane") as plane:
        root = Path(tmp) / "ckpt"
        stall = bench_stall(plane.nats.url, root, args.params, args.reps)
        commit = asyncio.run(bench_commit(plane, root, stall.pop("report"), args.commits))
    result = {"checkpoint_stall": stall, "checkpoint_commit": commit}
    gb = stall["bytes"] / 1e9
    a, s = stall["async"], stall["sync"]
    print("| checkpoint measure | value |\n| --- | --- |")
    print(f"| model | {stall['params'] / 1e6:.0f}M params + AdamW state, {gb:.2f} GB on disk |")
    print(f"| loop stall per save, async (dcp.async_save) | {a['blocked_s']:.2f} s "
          f"(write finishes after {a['total_s']:.2f} s) |")
    print(f"| loop stall per save, sync (dcp.save) | {s['blocked_s']:.2f} s |")
    print(f"| last report -> commit event, 4 ranks, verify=size (median / p95) | "
          f"{commit['small_4rank_size_ms']['median']:.1f} ms / "
          f"{commit['small_4rank_size_ms']['p95']:.1f} ms |")
    print(f"| last report -> commit event, {gb:.2f} GB, verify=size | "
          f"{commit['real_size_ms']:.1f} ms |")
    print(f"| last report -> commit event, {gb:.2f} GB, verify=full (CRC32 re-read) | "
          f"{commit['real_full_ms']:.0f} ms |")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
