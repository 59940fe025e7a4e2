"""The data stream's position: kept by step, restored from checkpoints and snapshots."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from trainguard.client import Guard
from trainguard.torch import BatchCheck, Batches, Checkpointer
from trainguard.torch.snapshots import MemorySnapshots

DATA = list(range(40))


def ids(batch: torch.Tensor) -> list[int]:
    return [int(v) for v in batch]


def stateful() -> StatefulDataLoader:
    """Shuffled by a seeded, epoch-keyed sampler (torchdata 0.11 restores a RandomSampler
    that shares the loader's generator exactly within the epoch only)."""
    sampler = DistributedSampler(DATA, num_replicas=1, rank=0, shuffle=True, seed=3)
    return StatefulDataLoader(DATA, batch_size=4, sampler=sampler,
                              generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("make", [stateful, lambda: DataLoader(DATA, batch_size=4)],
                         ids=["stateful", "plain"])
def test_a_restored_position_continues_the_stream_exactly(make: object) -> None:
    straight = Batches(make())  # type: ignore[operator]
    expected = [ids(straight.next(n)) for n in range(25)]  # crosses two epoch ends
    first = Batches(make())  # type: ignore[operator]
    seen = [ids(first.next(n)) for n in range(13)]
    saved = first.encoded()
    again = Batches(make())  # type: ignore[operator]
    again.restore_encoded(saved)
    seen += [ids(again.next(n)) for n in range(13, 25)]
    assert seen == expected
    assert again.epoch == 2


def test_each_epoch_is_reshuffled_through_set_epoch() -> None:
    class Sampler(torch.utils.data.Sampler[int]):
        def __init__(self) -> None:
            self.epoch = -1

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(torch.randperm(len(DATA),
                                       generator=torch.Generator().manual_seed(self.epoch))
                        .tolist())

        def __len__(self) -> int:
            return len(DATA)

    sampler = Sampler()
    b = Batches(DataLoader(DATA, batch_size=40, sampler=sampler))
    e0, e1 = ids(b.next(0)), ids(b.next(1))
    assert sampler.epoch == 1 and sorted(e0) == sorted(e1) == DATA and e0 != e1


def rewindable() -> Batches:
    """As under an in-place recovery (its hook sets ``rewinds``)."""
    b = Batches(stateful())
    b.rewinds = True
    return b


def test_an_abandoned_step_reads_its_batch_again() -> None:
    b = rewindable()
    first = [ids(b.next(n)) for n in range(4)]
    assert b.position_before(3) is not None and b.position_before(7) is None
    b.rewind(3, shared=None)  # step 3 was abandoned: run again
    assert ids(b.next(3)) == first[3]
    b.rewind(4, shared=None)  # already there: nothing moves
    following = ids(b.next(4))
    assert following not in first


def test_a_replacement_takes_the_shared_position() -> None:
    source = rewindable()
    batches = [ids(source.next(n)) for n in range(6)]
    shared = source.position_before(5)
    fresh = rewindable()
    assert fresh.position_before(5) is None
    fresh.rewind(5, shared)
    assert ids(fresh.next(5)) == batches[5]


def test_without_an_in_place_recovery_no_position_is_kept_by_step() -> None:
    b = Batches(stateful())
    assert not b.rewinds
    [b.next(n) for n in range(3)]
    assert b.position_before(2) is None and b.position_before(3) is not None


def test_an_empty_loader_is_an_error_not_a_loop() -> None:
    with pytest.raises(RuntimeError, match="no batch"):
        Batches(DataLoader([], batch_size=4)).next(0)


def test_next_runs_the_batch_check() -> None:
    guard = Guard(job="j", rank=0, world_size=1, enabled=False)

    class Step:
        n = 0
        batch_fault = None

    data = Batches(DataLoader([torch.tensor([float("nan")])] * 4, batch_size=1),
                   check=BatchCheck(guard, skip=False))
    step = Step()
    data.next(step)
    assert step.batch_fault is not None and step.batch_fault.kind == "nonfinite"


def test_memory_snapshots_carry_the_position() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = Batches(stateful())
    snaps = MemorySnapshots(1, 3, position=data.position, set_position=data.restore)
    [data.next(n) for n in range(3)]
    snaps.take(2, model, opt)
    after = [ids(data.next(n)) for n in range(3, 6)]
    snaps.restore(2, model, opt)
    assert [ids(data.next(n)) for n in range(3, 6)] == after
    snaps.close()


def test_a_checkpoint_carries_the_position(tmp_path: Path) -> None:
    guard = Guard(job="pos", rank=0, world_size=1, enabled=False)
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = Batches(stateful())
    ckpt = Checkpointer(guard, tmp_path, use_async=False, memory=None, data=data)
    for n in range(5):
        data.next(n)
    ckpt.save(4, model, opt)
    ckpt.wait()
    following = [ids(data.next(n)) for n in range(5, 9)]
    ckpt.close()

    data2 = Batches(stateful())
    ckpt2 = Checkpointer(guard, tmp_path, use_async=False, memory=None, data=data2)
    assert ckpt2.load(ckpt.path_for(4), model, opt) == 4
    assert [ids(data2.next(n)) for n in range(5, 9)] == following
    ckpt2.close()
