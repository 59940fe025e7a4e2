"""Memory snapshots (``trainguard.torch.snapshots``) with a real model and AdamW: a restore
puts back exactly the state of its step (parameters, optimizer moments and step counts,
learning rate, RNG), in place; a snapshot that fails its checksum, holds a non-finite
value or no longer fits the state is refused and says why; the kept ones reach back in
time; ``every="auto"`` spaces them by the copy's measured cost."""

from __future__ import annotations

import functools
import queue
from collections.abc import Callable
from typing import Any

import pytest
import torch

from trainguard.torch.checkpoint import _rng_state, _set_rng_state
from trainguard.torch.snapshots import (
    MemorySnapshots,
    Snapshot,
    SnapshotRefused,
    auto_interval,
    live_state,
    pick_victim,
)


class Masked(torch.nn.Module):
    """Two layers and a buffer that is -inf by design (a causal mask's upper triangle)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                       torch.nn.Linear(16, 4))
        self.register_buffer("mask", torch.full((4, 4), float("-inf")).triu(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


def trainer(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Masked()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    x = torch.randn(5, 8)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    for g in opt.param_groups:
        g["lr"] = 1e-2 / (1 + step)  # a schedule: restored with the state


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {**{n: t.clone() for n, t in live_state(model, opt)},
            "lr": opt.param_groups[0]["lr"], "rng": torch.get_rng_state().clone()}


def same(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return [k for k in a if not (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor)
                                 else a[k] == b[k])]


def snapshots(**kw: Any) -> MemorySnapshots:
    return MemorySnapshots(**{"every": 1, "keep": 3, "spacing": 0.0, "rng": _rng_state,
                              "set_rng": _set_rng_state, **kw})


def test_a_restore_puts_back_the_state_of_its_step_in_place() -> None:
    model, opt = trainer()
    mem = snapshots()
    params = [p for p in model.parameters()]
    expected: dict[int, dict[str, Any]] = {}
    for step in range(6):
        train(model, opt, step)
        expected[step] = state_of(model, opt)
        mem.step_done(step, model, opt, functools.partial(dict, data=step))
    assert mem.held(below=100) == [3, 4, 5]  # keep=3
    assert mem.held(below=5) == [3, 4]
    assert mem.restore(4, model, opt) == {"data": 4}
    assert same(expected[4], state_of(model, opt)) == []
    assert [p for p in model.parameters()] == params  # the same tensors, restored in place
    # Training on from the restored state repeats what followed it.
    train(model, opt, 5)
    assert same(expected[5], state_of(model, opt)) == []
    assert mem.held(below=100) == [3, 4]  # step 5's snapshot was of the abandoned timeline
    mem.close()


def test_a_corrupted_snapshot_is_refused_and_says_why() -> None:
    model, opt = trainer()
    mem = snapshots()
    for step in range(3):
        train(model, opt, step)
        mem.step_done(step, model, opt)
    mem.held(below=100)  # waits for the checks
    before = state_of(model, opt)
    snap = mem.ring[-1]
    flipped = snap.tensors[0].view(-1)[:1].view(torch.int32)
    flipped ^= 1 << 20  # one bit of host memory
    assert "failed its checksum" in mem.verify(2, model, opt)
    with pytest.raises(SnapshotRefused, match="failed its checksum"):
        mem.restore(2, model, opt)
    assert same(before, state_of(model, opt)) == []  # nothing was touched
    assert mem.verify(1, model, opt) == ""
    assert "no snapshot of step 7" in mem.verify(7, model, opt)
    mem.close()


def test_a_snapshot_with_non_finite_values_is_never_restored_and_keeps_the_clean_ones() -> None:
    model, opt = trainer()
    mem = snapshots()
    for step in range(4):
        train(model, opt, step)
        mem.step_done(step, model, opt)
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] = float("nan")
    assert mem.step_done(4, model, opt)
    assert mem.held(below=100) == [2, 3]
    assert "non-finite" in mem.verify(4, model, opt)
    for step in range(5, 9):  # frozen: the clean ones stay
        assert not mem.step_done(step, model, opt)
    assert [s.step for s in mem.ring] == [2, 3, 4]
    mem.restore(3, model, opt)
    assert bool(torch.isfinite(next(model.parameters())).all())
    train(model, opt, 4)
    assert mem.step_done(4, model, opt)  # taking snapshots again
    assert mem.held(below=100) == [2, 3, 4]
    mem.close()


def test_a_snapshot_that_no_longer_fits_the_state_is_refused() -> None:
    model, opt = trainer()
    mem = snapshots()
    mem.step_done(0, model, opt)  # before the first optimizer step: no moments yet
    train(model, opt, 0)
    assert "tensors changed" in mem.verify(0, model, opt)
    other, other_opt = torch.nn.Sequential(torch.nn.Linear(8, 3)), None
    mem.step_done(1, other, other_opt)
    assert "tensors changed" in mem.verify(1, model, opt)
    mem.close()


def test_the_kept_snapshots_reach_back_by_spacing() -> None:
    """The newest slot moves at every snapshot; an older one is kept once the newest is
    ``spacing`` younger than it (the clock here is each snapshot's own stamp)."""
    model, opt = trainer()
    mem = snapshots(spacing=10.0)
    clock = iter(range(0, 1000, 2))  # a snapshot every 2 s
    for step in range(40):
        snap = mem.take(step, model, opt)
        snap.taken = float(next(clock))
    taken = [s.taken for s in mem.ring]
    assert len(taken) == 3 and taken[-1] == 78.0
    assert taken[1] - taken[0] >= 10.0  # the older ones at least spacing apart
    assert taken[-1] - taken[0] >= 10.0  # a rollback 10 s back finds one below its onset
    mem.close()


def test_a_fingerprinted_step_is_snapshotted_and_kept_until_two_newer_ones() -> None:
    """A replica mismatch is found at a fingerprint, after more snapshots were taken; its
    rollback goes below the step after the last fingerprint that agreed. The snapshots of
    the two newest fingerprinted steps stay whatever the spacing, and a fingerprinted step
    gets one even between the due ones."""
    model, opt = trainer()
    mem = snapshots(every=7, spacing=10.0)
    clock = iter(range(0, 1000, 1))
    for step in range(61):
        train(model, opt, step)
        if mem.step_done(step, model, opt, anchor=step % 20 == 0):
            mem.ring[-1].taken = float(next(clock))
        held = mem.held(below=10**6)
        done = [a for a in (0, 20, 40, 60) if a <= step]
        assert set(done[-2:]) <= set(held), (step, held)  # the two newest fingerprints
        assert held[-1] >= step - 6  # and a recent one
    mem.close()


def test_without_anchors_the_ring_keeps_its_spacing_rule() -> None:
    snaps = [Snapshot(step=i, names=[], tensors=[], values={}, taken=float(t), nbytes=0)
             for i, t in enumerate((0, 12, 15))]
    assert pick_victim(snaps, 10.0) is snaps[2]  # the newest, 3 s after the one before
    snaps[2].taken = 30.0
    assert pick_victim(snaps, 10.0) is snaps[0]  # the newest stays, as an older one
    snaps[0].anchor = snaps[1].anchor = True
    assert pick_victim(snaps, 10.0) is snaps[2]  # the two anchors stay


def test_auto_spaces_the_snapshots_by_their_measured_cost() -> None:
    # A 10 ms copy and 20 ms steps: 5% of a step is 1 ms, so every 10 steps.
    assert auto_interval(0.010, 0.020, 0.05) == 10
    assert auto_interval(0.0001, 0.020, 0.05) == 1
    model, opt = trainer()
    mem = MemorySnapshots("auto", keep=2)
    taken = []
    for step in range(20):
        train(model, opt, step)
        if mem.step_done(step, model, opt):
            taken.append(step)
    assert taken[0] == 0  # the first at once; then as the measured cost allows
    with pytest.raises(ValueError, match="whole number of steps"):
        MemorySnapshots(0)
    mem.close()


def test_extra_is_read_only_for_the_steps_that_take_a_snapshot() -> None:
    model, opt = trainer()
    mem = snapshots(every=3)
    asked: list[int] = []

    def extra_of(step: int) -> Callable[[], dict[str, int]]:
        def extra() -> dict[str, int]:
            asked.append(step)
            return {"s": step}
        return extra

    for step in range(7):
        mem.step_done(step, model, opt, extra_of(step))
    assert asked == [0, 3, 6]
    mem.close()


def test_on_checked_sees_each_clean_snapshot_once_checked_and_never_a_poisoned_one() -> None:
    """The report hook runs on the check thread once a snapshot is verified, with the
    snapshot still kept and counted among the clean ones; a poisoned one is never told."""
    model, opt = trainer()
    seen: queue.Queue[tuple[int, list[int], float, float]] = queue.Queue()
    mem: MemorySnapshots
    mem = snapshots(keep=2, on_checked=lambda s: seen.put(
        (s.step, mem.kept(), s.copy_seconds, s.check_seconds)))
    for step in range(3):
        train(model, opt, step)
        mem.step_done(step, model, opt)
        told, kept, copy, check = seen.get(timeout=30)
        assert (told, kept) == (step, [max(0, step - 1), step] if step else [0])
        assert copy > 0 and check > 0
    assert mem.interval == 1
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] = float("nan")
    assert mem.step_done(3, model, opt)
    assert "non-finite" in mem.verify(3, model, opt)
    mem.close()  # waits for the check thread: its hook has run, or never will
    assert seen.empty()
