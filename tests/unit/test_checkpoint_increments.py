"""Incremental checkpoints: the hashing, the ranks' decision, and a chain on real DCP files."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.unit.test_checkpoint_client import offline_guard, queued_reports
from trainguard.contract.commit_record import COMMIT_FILE, CommitRecord, encode_commit
from trainguard.contract.errors import ConfigError
from trainguard.contract.increment import INCREMENT_FILE, decode_increment
from trainguard.contract.schemas import FileDigest
from trainguard.torch import Checkpointer
from trainguard.torch.increments import (
    Chain,
    Decision,
    RankView,
    decide,
    graft,
    only,
    tensor_digest,
    tensor_leaves,
    without,
)
from trainguard.torch.trusted import CheckpointRefused


def test_a_digest_changes_with_any_byte_dtype_or_shape() -> None:
    t = torch.arange(12, dtype=torch.float32)
    assert tensor_digest(t) == tensor_digest(t.clone())
    u = t.clone()
    u[7] = torch.nextafter(u[7], torch.tensor(100.0))  # one bit
    assert tensor_digest(u) != tensor_digest(t)
    assert tensor_digest(t.view(3, 4)) != tensor_digest(t)
    assert tensor_digest(t.view(torch.int32)) != tensor_digest(t)
    assert tensor_digest(t.view(3, 4).t()) == tensor_digest(t.view(3, 4).t().contiguous())
    assert tensor_digest(torch.tensor(3.0)) != tensor_digest(torch.tensor(4.0))  # 0-dim
    assert tensor_digest(torch.ones(2, requires_grad=True)) == tensor_digest(torch.ones(2))
    assert tensor_digest(torch.zeros(0)) != tensor_digest(torch.zeros(0, 2))
    sparse = torch.eye(3).to_sparse()
    assert tensor_digest(sparse) != tensor_digest(sparse)  # unreadable bytes: always written


def test_leaves_are_the_model_and_optimizer_tensors_by_path() -> None:
    w, m = torch.ones(2), torch.zeros(2)
    state = {"model": {"0.weight": w}, "optim": {"state": {"0.weight": {"exp_avg": m}},
                                                 "param_groups": [{"lr": 0.1}]},
             "rng": {"rank0": {"torch": torch.ones(3)}}, "trainguard": {"step": 3}}
    assert tensor_leaves(state) == {"model.0.weight": w, "optim.state.0.weight.exp_avg": m}
    # A path two leaves share is never left out.
    clash = {"model": {"a.b": torch.ones(1), "a": {"b": torch.ones(1)}, "c": torch.ones(1)}}
    assert list(tensor_leaves(clash)) == ["model.c"]

    cut = without(state, {"model.0.weight"})
    assert "0.weight" not in cut["model"] and cut["optim"]["state"]["0.weight"]["exp_avg"] is m
    part = only(state, {"model.0.weight"})
    assert part == {"model": {"0.weight": w}}
    assert graft(cut, part)["model"]["0.weight"] is w
    assert "0.weight" in state["model"]  # the original is left as it was


def test_the_ranks_leave_out_only_what_no_rank_saw_change() -> None:
    keys = ["model.a", "model.b", "model.c"]
    views = [RankView(10, 0, 3, ["model.a"]), RankView(10, 0, 3, ["model.b"])]
    assert decide(views, 4, keys) == Decision(10, {"model.c": 10})
    assert decide(views, 0, keys).base is None  # off
    assert decide([RankView(None, 0, 3)], 4, keys).why_full == "no base yet"
    assert decide([RankView(10, 0, 3), RankView(12, 0, 3)], 4, keys).why_full == \
        "no common base"
    assert decide([RankView(10, 4, 3), RankView(10, 4, 3)], 4, keys).base is None  # bound
    assert decide([RankView(10, 3, 3), RankView(10, 3, 3)], 4, keys).base == 10
    assert decide([RankView(10, 0, 3), RankView(10, 0, 2)], 4, keys).base is None
    assert decide([RankView(10, 0, 3, keys)], 4, keys).why_full == "every tensor changed"


def test_a_chain_rebases_on_a_full_save_that_succeeded_only() -> None:
    chain = Chain(2)
    now = {"model.a": b"1", "model.b": b"2"}
    assert chain.view(now) == RankView(None, 0, 2, [])
    chain.saving(5, Decision(None), now)
    chain.saved(ok=True)
    assert (chain.base, chain.increments) == (5, 0)
    assert chain.view({"model.a": b"1", "model.b": b"3"}).changed == ["model.b"]
    chain.saving(6, Decision(5, {"model.a": 5}), now)
    chain.saved(ok=True)
    assert chain.increments == 1
    chain.saving(7, Decision(None), now)
    chain.saved(ok=False)  # a failed full save may have left half its files
    assert chain.base is None


def make() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A frozen base (two wide layers) under a small trained head."""
    model = nn.Sequential(nn.Linear(16, 256), nn.Linear(256, 256), nn.Linear(256, 4))
    for layer in list(model)[:2]:
        layer.requires_grad_(False)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)


def train(model: nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    for _ in range(n):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return tensor_leaves(dict(zip(("model", "optim"), get_state_dict(model, opt),
                                  strict=True)))


def commit(path: Path, job: str, step: int, *, base: int | None = None,
           base_id: str = "") -> None:
    """The coordinator's commit record over every file in ``path``."""
    files = {p.name: FileDigest(bytes=p.stat().st_size, crc32=zlib.crc32(p.read_bytes()))
             for p in path.iterdir() if p.is_file() and p.name != COMMIT_FILE}
    record = CommitRecord(job=job, step=step, path=str(path), checkpoint_id=f"id{step}",
                          files=files, base=base, base_id=base_id)
    (path / COMMIT_FILE).write_bytes(encode_commit(record))


def test_an_increment_writes_what_changed_and_restores_bit_for_bit(tmp_path: Path) -> None:
    guard = offline_guard()
    torch.manual_seed(0)
    model, opt = make()
    ckpt = Checkpointer(guard, tmp_path, incremental=2, memory=None)
    train(model, opt, 1)
    for step in (0, 1, 2, 3):
        ckpt.save(step, model, opt, blocking=step == 3)
        ckpt.wait()
        if step == 2:
            expected = {k: v.clone() for k, v in full_state(model, opt).items()}
        train(model, opt, 1)
    reports = queued_reports(guard)
    assert [r.ok for r in reports] == [True] * 4, [r.error for r in reports]
    assert [r.base for r in reports] == [None, 0, 0, None]  # two increments, then full
    shards = [sum(d.bytes for n, d in r.files.items() if n.endswith(".distcp")) for r in reports]
    assert shards[1] < shards[0] / 3, shards  # the frozen 98% stays in step 0's files
    increment = decode_increment((ckpt.path_for(2) / INCREMENT_FILE).read_bytes())
    assert increment.base == 0 and set(increment.held) == {
        "model.0.weight", "model.0.bias", "model.1.weight", "model.1.bias"}
    assert INCREMENT_FILE in reports[1].files and INCREMENT_FILE not in reports[3].files

    torch.manual_seed(9)
    model2, opt2 = make()
    reader = Checkpointer(guard, tmp_path, incremental=2, memory=None)
    assert reader.load(ckpt.path_for(2), model2, opt2) == 2
    got = full_state(model2, opt2)
    assert got.keys() == expected.keys()
    for key, want in expected.items():
        assert torch.equal(got[key], want), key
    ckpt.close()
    reader.close()
    guard.close(timeout=0.1)


def test_a_broken_base_refuses_the_increment(tmp_path: Path) -> None:
    guard = offline_guard()
    model, opt = make()
    ckpt = Checkpointer(guard, tmp_path, incremental=3, memory=None)
    for step in (0, 1):
        train(model, opt, 1)
        ckpt.save(step, model, opt, blocking=True)
    base, head = ckpt.path_for(0), ckpt.path_for(1)
    commit(base, "ckjob", 0)
    commit(head, "ckjob", 1, base=0, base_id="id0")
    assert ckpt.load(head, model, opt) == 1
    shard = next(base.glob("__0_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointRefused, match="CRC32"):
        ckpt.load(head, model, opt)
    shard.unlink()
    with pytest.raises(CheckpointRefused, match=r"step-0/__0_.* is unreadable"):
        ckpt.load(head, model, opt)
    commit(base, "ckjob", 0)  # committed again, as another checkpoint
    (base / COMMIT_FILE).write_bytes((base / COMMIT_FILE).read_bytes().replace(b"id0", b"id9"))
    with pytest.raises(CheckpointRefused, match="not the base id0"):
        ckpt.load(head, model, opt)
    ckpt.close()
    guard.close(timeout=0.1)


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_a_bad_incremental_setting_is_refused(tmp_path: Path, value: object) -> None:
    guard = offline_guard()
    with pytest.raises(ConfigError, match="incremental="):
        Checkpointer(guard, tmp_path, incremental=value)  # type: ignore[arg-type]
    guard.close(timeout=0.1)


def test_the_environment_sets_incremental_saves(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    guard = offline_guard()
    monkeypatch.setenv("TRAINGUARD_CHECKPOINT_INCREMENTAL", "5")
    for value, expected in ((None, 5), (0, 0)):
        ckpt = Checkpointer(guard, tmp_path, memory=None, incremental=value)
        assert ckpt.chain.every == expected
        ckpt.close()
    monkeypatch.setenv("TRAINGUARD_CHECKPOINT_INCREMENTAL", "often")
    with pytest.raises(ConfigError, match="TRAINGUARD_CHECKPOINT_INCREMENTAL='often'"):
        Checkpointer(guard, tmp_path, memory=None)
    guard.close(timeout=0.1)
