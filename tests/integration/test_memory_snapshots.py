"""Memory snapshots visible to operators, against real NATS, Redis and the coordinator.

Two ranks, each a real Guard with a real ``Checkpointer(memory=1)`` on a tiny torch model,
train through ``guard.steps``; their snapshot reports travel the Guard's telemetry path to
the checkpoint coordinator, which keeps them in Redis. ``trainguard checkpoints`` (the CLI
function itself) then shows the memory row, and the coordinator's series follow it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import wait_until
from tests.integration.recorder import running
from tests.integration.test_checkpointer import coordinator_settings
from tests.integration.test_service import collect_dead
from trainguard import Guard
from trainguard.cli import checkpoints as cli
from trainguard.contract.codec import decode_telemetry, encode_telemetry
from trainguard.contract.rpc import ROLLBACK, RollbackRequest, call
from trainguard.contract.schemas import SnapshotReport
from trainguard.contract.subjects import Subjects
from trainguard.runtime.topology import provision, streams
from trainguard.services.checkpointer.service import CheckpointerService
from trainguard.torch import Checkpointer


def train(job: str, rank: int, steps: int, nats_url: str, prefix: str, root: Path) -> int:
    """Rank ``rank`` of 2 trains ``steps`` steps with a memory snapshot after each, then
    closes (the newest report held back by the throttle goes out on the way). Returns the
    size of one snapshot."""
    guard = Guard(job=job, rank=rank, world_size=2, host=f"h{rank}", nats_url=nats_url,
                  prefix=prefix, heartbeat_interval=60)
    torch.manual_seed(rank)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    guard.attach(model, opt)
    ckpt = Checkpointer(guard, root, memory=1, memory_keep=3, use_async=False)
    try:
        for step in guard.steps(0, steps):
            with guard.step(step):
                loss = model(torch.randn(4, 8)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
        assert ckpt.memory is not None
        return ckpt.memory.ring[-1].nbytes
    finally:
        guard.close(timeout=5.0)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


async def test_the_ranks_memory_snapshots_show_beside_the_checkpoints(
        nats_url: str, redis_url: str, prefix: str, job: str, tmp_path: Path, nc: Any,
        capsys: pytest.CaptureFixture[str]) -> None:
    await provision(nc.jetstream(), streams(prefix))
    svc = CheckpointerService(coordinator_settings(nats_url, redis_url, prefix))
    async with running(svc) as rt:
        common = ["checkpoints", "--job", job, "--nats", nats_url, "--prefix", prefix]

        async def catalogue() -> dict[str, Any]:
            assert await asyncio.to_thread(cli.run_checkpoints, parse([*common, "--json"])) == 0
            data: dict[str, Any] = json.loads(capsys.readouterr().out)
            return data

        assert (await catalogue())["memory"] is None  # no rank has reported yet
        started = time.time()
        # Rank 0 gets to step 5, rank 1 only to step 3: every rank holds step 3.
        sizes = await asyncio.gather(
            asyncio.to_thread(train, job, 0, 6, nats_url, prefix, tmp_path),
            asyncio.to_thread(train, job, 1, 4, nats_url, prefix, tmp_path))

        async def both() -> dict[str, Any] | None:
            memory = (await catalogue())["memory"]
            return memory if memory and memory["ranks"] == [0, 1] else None

        memory = await wait_until(both, what="both ranks' memory snapshots")
        # Each rank's newest arrives, whatever the throttle held back.
        memory = await wait_until(lambda: _newest(catalogue, 3), what="step 3 everywhere")
        assert memory["world_size"] == 2 and memory["every"] == 1
        # Three kept per rank; the newest slot moves while the older ones are less than
        # 10 s apart, so steps 0 and 1 stay.
        assert memory["oldest_step"] == 0
        assert memory["host_bytes"] == 3 * max(sizes) and memory["bytes"] == max(sizes)
        assert started <= memory["taken"] <= time.time()
        assert 0 <= memory["age"] < 60 and memory["oldest_age"] >= memory["age"]
        assert memory["copy_seconds"] > 0

        assert await asyncio.to_thread(cli.run_checkpoints, parse(common)) == 0
        table = capsys.readouterr().out.splitlines()
        row = next(line for line in table if " memory " in line)
        assert row.split()[:4] == ["3", "held", "memory", "2/2"]
        assert "oldest kept 0" in row
        assert "no checkpoints" not in table

        registry = rt.metrics.registry

        def series(name: str) -> float | None:
            return registry.get_sample_value(name, {"training_job": job})

        await wait_until(lambda: series("trainguard_memory_snapshot_step") == 3,
                         what="the memory snapshot series")
        assert series("trainguard_memory_snapshot_host_bytes") == 3 * max(sizes)
        age = series("trainguard_memory_snapshot_age_seconds")
        assert age is not None and 0 <= age < 60
        copy = series("trainguard_memory_snapshot_copy_seconds")
        assert copy == pytest.approx(memory["copy_seconds"])

        # Nothing on disk yet: a rollback below step 3 goes back to the ranks' memory (to
        # step 2 at the newest); below step 0 there is nothing to go back to at all.
        subjects = Subjects(prefix)
        back = await call(nc, subjects, job, ROLLBACK, RollbackRequest(below_step=3), 10)
        assert (back.ok, back.step, back.memory_step) == (False, None, 2), back
        assert "reload in place from memory" in back.reason
        none = await call(nc, subjects, job, ROLLBACK, RollbackRequest(below_step=0), 10)
        assert (none.step, none.memory_step) == (None, None)
        assert "starts from scratch" in none.reason

        # A report that speaks for another rank than its subject is dead-lettered unread.
        dead = await collect_dead(nc, prefix, job)
        forged = SnapshotReport(job=job, time=time.time(), rank=1, step=1, taken=time.time(),
                                kept_steps=[1], world_size=2)
        await nc.publish(Subjects(prefix).snap(job, 0), encode_telemetry(forged))
        [letter] = await wait_until(lambda: dead, what="the forged report's dead letter")
        assert letter.service == "checkpointer" and "rank 1" in letter.reason
        assert decode_telemetry(letter.payload).rank == 1
        assert (await catalogue())["memory"]["newest_step"] == 3


async def _newest(catalogue: Any, step: int) -> dict[str, Any] | None:
    memory: dict[str, Any] | None = (await catalogue())["memory"]
    return memory if memory and memory["newest_step"] == step else None
