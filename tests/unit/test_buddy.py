"""Buddy copies (``trainguard.torch.buddy``) over real loopback sockets: the pairing never
puts a buddy on its own host (nor, where it can, in its own failure domain); each checked
snapshot reaches the buddy off the training thread, the buddy keeps the last two, and a
copy restores the owner's exact state into a fresh replacement; a copy with a flipped byte
or a header without the job's key is never used."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.unit.test_snapshots import same, snapshots, state_of, train, trainer
from trainguard.torch.buddy import Buddies, buddy_targets

WAIT = 10.0


@pytest.mark.parametrize(("hosts", "domains"), [
    (["a", "a", "b", "b"], None),
    (["a", "b", "a", "b"], None),
    (["a", "a", "a", "b", "b", "c"], None),
    (["a", "a", "b", "b", "c", "c", "d", "d"], ["s1", "s1", "s1", "s1", "s2", "s2", "s2", "s2"]),
])
def test_a_buddy_is_on_another_host_and_each_rank_holds_one(
        hosts: list[str], domains: list[str] | None) -> None:
    targets = buddy_targets(hosts, domains)
    assert all(t is not None and hosts[t] != hosts[r] for r, t in enumerate(targets))
    assert sorted(t for t in targets if t is not None) == list(range(len(hosts)))
    if domains:
        assert all(t is not None and domains[t] != domains[r] for r, t in enumerate(targets))


def test_a_buddy_pairing_falls_back_to_hosts_and_to_none() -> None:
    # One domain holds every rank: another host of it, then.
    assert buddy_targets(["a", "a", "b", "b"], ["s", "s", "s", "s"]) == [2, 3, 0, 1]
    assert buddy_targets(["a", "a"]) == [None, None]
    # Three of four ranks on one host: every rank still sends off its host.
    targets = buddy_targets(["a", "a", "a", "b"])
    assert all(t is not None and (t == 3) != (r == 3) for r, t in enumerate(targets))


@pytest.fixture
def pair() -> Iterator[tuple[Buddies, Buddies]]:
    a, b = Buddies(0, keep=2), Buddies(1, keep=2)
    key = Buddies.new_key()
    for me in (a, b):
        me.pair(key, [0, 1], [a.address, b.address], ["h0", "h1"])
    yield a, b
    a.close()
    b.close()


def test_each_snapshot_reaches_the_buddy_which_keeps_the_last_two(
        pair: tuple[Buddies, Buddies]) -> None:
    a, b = pair
    assert (a.target_rank, b.target_rank, a.held_for) == (1, 0, [1])
    model, opt = trainer()
    mem = snapshots(on_checked=a.send)
    expected = {}
    for step in range(4):
        train(model, opt, step)
        expected[step] = state_of(model, opt)
        mem.step_done(step, model, opt)
        assert a.wait_sent(step, WAIT), (step, a.sent, a.failures)
    assert b.held() == {0: [2, 3]} and a.held() == {}
    assert b.nbytes == 2 * mem.ring[-1].nbytes
    # A replacement of rank 0 (a fresh model, and an optimizer with no state yet) asks
    # rank 1 for the copy of step 2 and restores it: rank 0's exact state.
    fresh, fresh_opt = trainer(seed=5)
    copy = a.fetch(b.address, rank=0, step=2)
    assert copy is not None and copy.check() == ""
    mine = snapshots()
    mine.adopt(copy.snapshot())
    assert "changed since the snapshot" in mine.verify(2, fresh, fresh_opt)
    mine.prime(2, fresh_opt)
    mine.restore(2, fresh, fresh_opt)
    assert same(expected[2], state_of(fresh, fresh_opt)) == []
    assert a.fetch(b.address, rank=0, step=0) is None  # no longer kept
    mem.close()
    mine.close()


def test_a_flipped_byte_or_a_foreign_key_is_never_used(pair: tuple[Buddies, Buddies]) -> None:
    a, b = pair
    model, opt = trainer()
    mem = snapshots(on_checked=a.send)
    train(model, opt, 0)
    mem.step_done(0, model, opt)
    copy = b.wait_held(0, 0, WAIT)
    assert copy is not None and copy.check() == ""
    copy.data[len(copy.data) // 2] ^= 0xFF
    assert "failed its checksum" in copy.check()
    fresh, fresh_opt = trainer(seed=5)
    train(fresh, fresh_opt, 0)
    mine = snapshots()
    mine.adopt(copy.snapshot())
    assert "failed its checksum" in mine.verify(0, fresh, fresh_opt)
    # A listener that does not hold the job's key is not answered, nor believed.
    stranger = Buddies(9)
    stranger.pair(Buddies.new_key(), [9, 1], [stranger.address, b.address], ["x", "h1"])
    with pytest.raises((OSError, ValueError)):
        stranger.fetch(b.address, rank=0, step=0)
    stranger.close()
    mem.close()
    mine.close()


def test_a_snapshot_being_sent_is_not_overwritten_by_the_next(
        pair: tuple[Buddies, Buddies]) -> None:
    a, b = pair
    model, opt = trainer()
    mem = snapshots(keep=1, on_checked=a.send)
    for step in range(6):  # keep=1: every snapshot reuses the buffers of the one sent
        train(model, opt, step)
        mem.step_done(step, model, opt)
    assert a.wait_sent(5, WAIT)
    for step in b.held()[0]:
        held = b.copy(0, step)
        assert held is not None and held.check() == ""
    assert torch.equal(b.copy(0, 5).tensors()[0], mem.ring[-1].tensors[0])  # type: ignore[union-attr]
    mem.close()


def test_the_corrupt_copies_drill_spoils_what_is_held_and_what_comes(
        pair: tuple[Buddies, Buddies]) -> None:
    a, b = pair
    model, opt = trainer()
    mem = snapshots(on_checked=a.send)
    train(model, opt, 0)
    mem.step_done(0, model, opt)
    assert a.wait_sent(0, WAIT)
    assert "a byte flipped in 1 copies" in b.corrupt()
    train(model, opt, 1)
    mem.step_done(1, model, opt)
    assert a.wait_sent(1, WAIT)  # acknowledged: it arrived whole, then went bad here
    assert [bool(b.copy(0, s).check()) for s in (0, 1)] == [True, True]  # type: ignore[union-attr]
    mem.close()
