"""The command agreement's pure parts: when a group agrees (Cadence) and what one
all-reduce settles (agree)."""

from __future__ import annotations

from collections.abc import Sequence

from trainguard.recovery.agreement import FIRST_EVERY, NONE_HELD, Cadence, agree


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_before_the_first_agreement_boundaries_are_multiples_of_first_every() -> None:
    cadence = Cadence(sync_every=1000)
    assert [s for s in range(1337, 1400) if cadence.due(s)] == \
        [s for s in range(1337, 1400) if s % FIRST_EVERY == 0]
    assert [s for s in range(1, 10) if Cadence(sync_every=4).due(s)] == [4, 8]


def test_the_interval_follows_step_time_capped_at_sync_every() -> None:
    clock = Clock()
    cadence = Cadence(sync_every=20, sync_period=0.25, clock=clock)
    assert cadence.proposed_interval() == 1  # no step time yet: agree at the next step
    for _ in range(30):
        clock.now += 0.05
        cadence.step_done()
    assert cadence.proposed_interval() == 5  # 0.25 s of 50 ms steps
    for _ in range(60):
        clock.now += 0.0001
        cadence.step_done()
    assert cadence.proposed_interval() == 20


def test_an_untimed_step_is_no_step_time() -> None:
    clock = Clock()
    cadence = Cadence(sync_every=20, sync_period=0.25, clock=clock)
    cadence.step_done()
    clock.now += 60.0  # a re-form: a minute without a step
    cadence.step_done(timed=False)
    clock.now += 0.05
    cadence.step_done()
    clock.now += 0.05
    cadence.step_done()
    assert cadence.proposed_interval() == 5


def test_after_an_agreement_the_next_is_the_agreed_steps_on_or_a_rollback_before() -> None:
    cadence = Cadence(sync_every=100)
    cadence.agreed(40, 7)
    assert [s for s in range(41, 60) if cadence.due(s)] == list(range(47, 60))
    assert cadence.due(12)  # rolled back before the last agreement: agree at once
    cadence.restart_at(12)  # a re-formed group agrees from where it continues
    assert cadence.due(12)
    cadence.agreed(12, 3)
    assert [s for s in range(12, 20) if cadence.due(s)] == list(range(15, 20))


def test_agree_reduces_the_lowest_held_as_a_max_of_negations() -> None:
    votes = [[3, 1, 5, -NONE_HELD], [4, 2, 2, -2], [1, 1, 9, -3]]

    def all_reduce_max(mine: Sequence[int]) -> list[int]:
        assert list(mine) in votes
        return [max(column) for column in zip(*votes, strict=True)]

    out = agree(all_reduce_max, highest_seq=4, generation=2, interval=2, lowest_held=2)
    assert out == (4, 2, 9, 2)
    assert out.floor == 2 and out.interval == 9
