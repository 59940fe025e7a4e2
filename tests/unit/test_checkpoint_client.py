"""``trainguard.torch.Checkpointer`` in one process (no process group): real DCP files."""

from __future__ import annotations

import time
import zlib
from pathlib import Path

import torch
from torch import nn

from trainguard import Guard
from trainguard.contract.schemas import CheckpointReport, Command
from trainguard.runtime.embedded import free_port
from trainguard.torch import Checkpointer
from trainguard.torch.checkpoint import rank_files


def offline_guard() -> Guard:
    """A Guard whose NATS URL is dead: what it publishes stays queued, for inspection."""
    return Guard(job="ckjob", rank=0, world_size=1, host="h",
                 nats_url=f"nats://127.0.0.1:{free_port()}", heartbeat_interval=60)


def make() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.2), nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: nn.Module, opt: torch.optim.Optimizer, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        losses.append(loss.item())
    return losses


def queued_reports(guard: Guard) -> list[CheckpointReport]:
    return [o.msg for o in guard.transport.durable if isinstance(o.msg, CheckpointReport)]


def test_round_trip_continues_bit_for_bit(tmp_path: Path) -> None:
    guard = offline_guard()
    torch.manual_seed(1)
    model, opt = make()
    ckpt = Checkpointer(guard, tmp_path)
    train(model, opt, 3)
    ckpt.save(2, model, opt, extra={"epoch": 7, "cursor": torch.arange(5)})
    ckpt.wait()
    expected = train(model, opt, 4)

    torch.manual_seed(99)  # a different RNG stream and different initial weights
    model2, opt2 = make()
    reader = Checkpointer(guard, tmp_path)
    assert reader.load(ckpt.path_for(2), model2, opt2) == 2
    assert reader.loaded_extra["epoch"] == 7
    assert torch.equal(reader.loaded_extra["cursor"], torch.arange(5))
    assert train(model2, opt2, 4) == expected  # exact: weights, Adam moments and RNG restored
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    ckpt.close()
    reader.close()
    guard.close(timeout=0.1)


def test_each_save_reports_when_its_state_last_started_over(tmp_path: Path) -> None:
    """A save at or past a rollback counts only from state restored after it: the report
    says when the state was made or loaded, as of the save's start."""
    guard = offline_guard()
    model, opt = make()
    ckpt = Checkpointer(guard, tmp_path)
    made = ckpt.state_since
    train(model, opt, 1)
    ckpt.save(1, model, opt)
    ckpt.wait()
    before_load = time.time()
    assert ckpt.load(ckpt.path_for(1), model, opt) == 1
    loaded = ckpt.state_since
    assert loaded >= before_load > made
    ckpt.save(2, model, opt)
    ckpt.wait()
    assert [r.state_since for r in queued_reports(guard)] == [made, loaded]
    ckpt.close()
    guard.close(timeout=0.1)


def test_report_lists_each_file_with_size_and_crc(tmp_path: Path) -> None:
    guard = offline_guard()
    model, opt = make()
    ckpt = Checkpointer(guard, tmp_path)
    train(model, opt, 1)
    ckpt.save(5, model, opt)
    report = ckpt.wait()
    assert report is not None and report.ok, report
    assert queued_reports(guard) == [report]
    path = tmp_path / "ckjob" / "step-5"
    assert report.path == str(path) and report.step == 5 and report.world_size == 1
    assert ".metadata" in report.files and any(n.startswith("__0_") for n in report.files)
    for name, digest in report.files.items():
        data = (path / name).read_bytes()
        assert digest.bytes == len(data) and digest.crc32 == zlib.crc32(data)
    assert report.bytes == sum(d.bytes for d in report.files.values())
    assert 0 <= report.seconds_blocked <= report.seconds_total
    ckpt.save(5, model, opt)  # the step saved last: not written twice
    assert ckpt.wait() is None and len(queued_reports(guard)) == 1
    ckpt.save(6, model, opt, blocking=True)
    blocking = queued_reports(guard)[-1]
    assert blocking.step == 6 and blocking.seconds_blocked == blocking.seconds_total
    ckpt.close()
    guard.close(timeout=0.1)


def test_save_now_saves_the_step_just_completed(tmp_path: Path) -> None:
    guard = offline_guard()
    model, opt = make()
    guard.attach(model, opt)
    ckpt = Checkpointer(guard, tmp_path)
    assert guard.checkpoint_root == str(tmp_path)
    for i in range(3):
        with guard.step(i):
            train(model, opt, 1)
    handler = guard.commands.handlers["save_now"]
    detail = handler(Command(id="c1", job="ckjob", kind="save_now", issuer="coordinator"))
    assert detail is not None and detail.startswith("step=2 ")
    assert ckpt.wait() is not None and (tmp_path / "ckjob" / "step-2" / ".metadata").exists()
    again = handler(Command(id="c2", job="ckjob", kind="save_now", issuer="coordinator",
                            at_step=2))
    assert again == "step=2 already saved"
    ckpt.close()
    guard.close(timeout=0.1)


def test_a_failed_save_is_reported_not_raised(tmp_path: Path) -> None:
    guard = offline_guard()
    model, opt = make()
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    ckpt = Checkpointer(guard, blocker)
    ckpt.save(1, model, opt)
    report = ckpt.wait()
    assert report is not None and not report.ok and report.error
    assert report.files == {}
    ckpt.close()
    guard.close(timeout=0.1)


def test_files_are_attributed_to_ranks_by_prefix() -> None:
    names = {"__0_0.distcp", "__1_0.distcp", "__1_1.distcp", "__10_0.distcp"}
    assert rank_files(names, 0) == ["__0_0.distcp", ".metadata"]
    assert rank_files(names, 1) == ["__1_0.distcp", "__1_1.distcp"]
    assert rank_files(names, 10) == ["__10_0.distcp"]
