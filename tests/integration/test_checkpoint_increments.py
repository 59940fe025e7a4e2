"""Incremental checkpoints at the coordinator, against real NATS, Redis and files: an
increment commits only on a committed base, and retention keeps the bases it needs."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests.conftest import wait_until
from tests.integration.test_checkpointer import coordinator, write_shards
from tests.ranks import run_ranks
from trainguard.cli.checkpoints import format_catalogue
from trainguard.contract.commit_record import COMMIT_FILE, decode_commit
from trainguard.contract.schemas import CheckpointReport


def increment(reports: dict[int, CheckpointReport], base: int) -> dict[int, CheckpointReport]:
    return {r: msgspec.structs.replace(rep, base=base) for r, rep in reports.items()}


async def test_an_increment_commits_on_its_base_and_keeps_it(
        nats_url: str, redis_url: str, prefix: str, job: str, tmp_path: Path) -> None:
    async with coordinator(nats_url, redis_url, prefix, job, retain=1, delete_files=True) as c:
        # Every rank of step 11 reported before its base: it waits for the base's verdict.
        await c.report_all(increment(write_shards(tmp_path, job, 11, 2), base=10))
        await c.drained()
        entry = await c.entry(11)
        assert entry is not None and (entry["status"], entry["kind"], entry["base"]) == \
            ("pending", "incremental", 10)
        assert c.of(11) == []
        await c.report_all(write_shards(tmp_path, job, 10, 2))
        await c.event(10, "committed")
        await c.event(11, "committed")
        base_entry = await c.entry(10)
        assert base_entry is not None and base_entry["kind"] == "full"
        record = decode_commit((tmp_path / job / "step-11" / COMMIT_FILE).read_bytes())
        assert (record.base, record.base_id) == (10, base_entry["id"])
        assert (await c.resume()).step == 11  # type: ignore[union-attr]

        await c.report_all(increment(write_shards(tmp_path, job, 12, 2), base=10))
        await c.event(12, "committed")
        # retain=1 keeps step 12 only, and step 10, which a restore of it reads.
        await wait_until(lambda: not (tmp_path / job / "step-11").exists(),
                         what="step 11 deleted")
        data = await c.catalogue()
        statuses = {e["step"]: e["status"] for e in data["checkpoints"]}
        assert statuses == {10: "committed", 11: "deleted", 12: "committed"}
        assert (tmp_path / job / "step-10").is_dir()
        table = format_catalogue(data)
        assert "incr of 10" in table and " full " in table

        await c.report_all(write_shards(tmp_path, job, 20, 2))
        await c.event(20, "committed")
        await wait_until(lambda: not (tmp_path / job / "step-10").exists(),
                         what="the old base deleted once nothing needs it")
        assert not (tmp_path / job / "step-12").exists()


async def test_an_increment_on_a_failed_base_fails_and_says_why(
        nats_url: str, redis_url: str, prefix: str, job: str, tmp_path: Path) -> None:
    async with coordinator(nats_url, redis_url, prefix, job, commit_deadline=1.0) as c:
        await c.report_all(increment(write_shards(tmp_path, job, 31, 2), base=30))
        await c.drained()
        base = write_shards(tmp_path, job, 30, 2)
        base[1].ok, base[1].error = False, "disk full"
        await c.report_all(base)
        await c.event(30, "failed")
        failed = await c.event(31, "failed")
        assert "its base, step 30, is not committed (failed)" in failed.reason
        # One whose base never reports fails at its commit deadline.
        await c.report_all(increment(write_shards(tmp_path, job, 41, 2), base=40))
        assert "step 40, is not committed (no record)" in (await c.event(41, "failed")).reason
        assert await c.resume() is None


def _net() -> Any:
    """A frozen base (97% of the parameters) under a small trained head."""
    from torch import nn

    model = nn.Sequential(nn.Linear(32, 256), nn.Linear(256, 256), nn.Linear(256, 8))
    for layer in list(model)[:2]:
        layer.requires_grad_(False)
    return model


def _lay_out(model: Any, mode: str, world: int) -> tuple[Any, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if mode == "ddp":
        model = DistributedDataParallel(model)
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    trained = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trained, lr=1e-2)


def _guard(rank: int, world: int) -> Any:
    from trainguard import Guard
    from trainguard.runtime.embedded import free_port

    return Guard(job="incjob", rank=rank, world_size=world, host="h", heartbeat_interval=60,
                 nats_url=f"nats://127.0.0.1:{free_port()}")  # dead: reports stay queued


def _save_chain(rank: int, world: int, port: int, out: Any) -> None:
    """Per layout: full save at step 0, increments at 1 and 2, and a full save of step 2
    under another root, all in one run."""
    import torch
    import torch.distributed as dist

    from trainguard.torch import Checkpointer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    guard = _guard(rank, world)
    found: dict[str, Any] = {}
    try:
        for mode in ("ddp", "fsdp"):
            torch.manual_seed(0)
            model, opt = _lay_out(_net(), mode, world)
            root = Path(os.environ["INC_ROOT"]) / mode
            chain = Checkpointer(guard, root / "chain", incremental=3, memory=None)
            full = Checkpointer(guard, root / "full", memory=None)
            data = torch.Generator().manual_seed(rank)
            for step in range(3):
                loss = model(torch.randn(8, 32, generator=data)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                chain.save(step, model, opt)
            full.save(2, model, opt, blocking=True)
            chain.close()
            full.close()
            found[mode] = [(r.ok, r.error, r.base, sum(d.bytes for n, d in r.files.items()
                                                       if n.endswith(".distcp")))
                           for r in chain.reports]
        out.put((rank, found))
    finally:
        guard.close(timeout=0.1)
        dist.destroy_process_group()


def _restore(rank: int, world: int, port: int, out: Any) -> None:
    """A fresh process group: step 2 from its chain and from the full save, compared."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from trainguard.torch import Checkpointer
    from trainguard.torch.increments import tensor_leaves

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    guard = _guard(rank, world)
    found: dict[str, Any] = {}
    try:
        for mode in ("ddp", "fsdp"):
            root = Path(os.environ["INC_ROOT"]) / mode
            states = []
            for seed, where in ((1, "chain"), (2, "full")):
                torch.manual_seed(seed)  # different initial weights in each
                model, opt = _lay_out(_net(), mode, world)
                ckpt = Checkpointer(guard, root / where, memory=None)
                assert ckpt.load(ckpt.path_for(2), model, opt) == 2
                ckpt.close()
                sd = dict(zip(("model", "optim"), get_state_dict(model, opt), strict=True))
                states.append({k: getattr(v, "to_local", lambda v=v: v)().clone()
                               for k, v in tensor_leaves(sd).items()})
            chained, whole = states
            found[mode] = (sorted(chained) == sorted(whole), len(whole),
                           [k for k in whole if not torch.equal(chained[k], whole[k])])
        out.put((rank, found))
    finally:
        guard.close(timeout=0.1)
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2])
def test_a_chain_restores_bit_for_bit_as_a_full_save_replicated_and_sharded(
        world: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INC_ROOT", str(tmp_path))
    saved = run_ranks(_save_chain, world, timeout=240)
    for rank in range(world):
        for mode in ("ddp", "fsdp"):
            reports = saved[rank][mode]
            assert [(ok, err) for ok, err, _, _ in reports] == [(True, "")] * 3, reports
            assert [base for _, _, base, _ in reports] == [None, 0, 0]
    for mode in ("ddp", "fsdp"):
        # Every byte of the frozen base, once (DCP writes a replicated tensor on one rank),
        # is left to step 0.
        written = [sum(saved[r][mode][i][3] for r in range(world)) for i in range(3)]
        frozen = 4 * (32 * 256 + 256 + 256 * 256 + 256)
        assert min(written[0] - written[i] for i in (1, 2)) >= frozen, (mode, written)
    restored = run_ranks(_restore, world, timeout=240)
    for rank in range(world):
        for mode in ("ddp", "fsdp"):
            same_keys, count, differ = restored[rank][mode]
            assert same_keys and count > 6 and differ == [], (rank, mode, differ)
    # Both links reshard: the FSDP2 chain loads into one unsharded process as its full save.
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from trainguard.torch import Checkpointer
    from trainguard.torch.increments import tensor_leaves

    guard = _guard(0, 1)
    states = []
    for where in ("chain", "full"):
        model, opt = _lay_out_single()
        ckpt = Checkpointer(guard, tmp_path / "fsdp" / where, memory=None)
        assert ckpt.load(ckpt.path_for(2), model, opt) == 2
        ckpt.close()
        states.append(tensor_leaves(dict(zip(("model", "optim"), get_state_dict(model, opt),
                                             strict=True))))
    guard.close(timeout=0.1)
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[1])


async def test_a_broken_link_falls_back_to_the_newest_checkpoint_that_verifies(
        nats_url: str, redis_url: str, prefix: str, job: str, tmp_path: Path) -> None:
    """Steps 0 (full), 1 (increment on 0), 2 (full), 3 (increment on 2), committed by the
    coordinator; then a shard of step 3, then one of its base, is garbled: a resume loads the
    newest checkpoint whose every link verifies, and its recovery report says why."""
    import torch

    from trainguard import Guard
    from trainguard.contract.codec import decode_durable
    from trainguard.contract.schemas import RecoveryReport
    from trainguard.contract.subjects import Subjects
    from trainguard.torch import Checkpointer

    guard = Guard(job=job, rank=0, world_size=1, host="h", nats_url=nats_url, prefix=prefix,
                  heartbeat_interval=60)
    recoveries: list[RecoveryReport] = []
    async with coordinator(nats_url, redis_url, prefix, job) as c:
        async def on_recovery(msg: Any) -> None:
            recoveries.append(decode_durable(msg.data, RecoveryReport))

        await c.bus.nc.subscribe(Subjects(prefix).recovery(job, 0), cb=on_recovery)
        torch.manual_seed(0)
        model, opt = _lay_out_single()
        ckpt = Checkpointer(guard, tmp_path, incremental=1, memory=None)
        for step in range(4):
            opt.zero_grad()
            model(torch.randn(4, 32)).pow(2).mean().backward()
            opt.step()
            await asyncio.to_thread(ckpt.save, step, model, opt, blocking=True)
            await c.event(step, "committed")
        assert [r.base for r in ckpt.reports] == [None, 0, None, 2]

        def garble(step: int) -> str:
            shard = next(ckpt.path_for(step).glob("__0_*.distcp"))
            data = bytearray(shard.read_bytes())
            data[-100] ^= 0x01
            shard.write_bytes(bytes(data))
            return f"step-{step}/{shard.name}"

        async def resume() -> tuple[int, str]:
            fresh, fresh_opt = _lay_out_single()
            reader = Checkpointer(guard, tmp_path, incremental=1, memory=None)
            first = await asyncio.to_thread(reader.resume, fresh, fresh_opt, timeout=5.0)
            count = len(recoveries)
            with guard.step(first):  # the report goes out once a step has ended
                pass
            await wait_until(lambda: len(recoveries) > count, what="recovery report")
            reader.close()
            return first, recoveries[-1].reason

        broken = garble(3)
        first, reason = await resume()
        assert first == 3, reason  # step 2, the full one below
        assert "not the newer step 3" in reason and broken in reason and "CRC32" in reason
        base = garble(2)
        first, reason = await resume()
        assert first == 2, reason  # step 1, an increment on step 0, which verifies
        assert "step 3" in reason and "step 2" in reason and base in reason
    ckpt.close()
    guard.close(timeout=1.0)


def _lay_out_single() -> tuple[Any, Any]:
    import torch

    model = _net()
    trained = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trained, lr=1e-2)
