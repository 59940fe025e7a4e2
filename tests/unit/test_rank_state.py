"""The rank's own view of a stall: when the client sends a heartbeat early."""

from __future__ import annotations

from trainguard.core.identity import resolve_identity
from trainguard.core.rankstate import STALL_BEAT_FACTOR, STALL_BEAT_MIN_S, RankState


def stepped(durations: list[float]) -> RankState:
    state = RankState()
    for i, d in enumerate(durations):
        state.begin_step(i)
        state.end_step(d)
    return state


def test_no_early_beat_before_a_step_is_known_or_between_steps() -> None:
    state = RankState()
    state.begin_step(0)
    assert not state.stalled(state.step_t0 + 3600.0)  # type: ignore[operator]
    state.end_step(None)  # failed: no duration learnt
    assert state.usual_step is None and not state.stalled(1e12)


def test_one_early_beat_per_step_past_four_times_the_usual() -> None:
    state = stepped([0.2] * 10)
    state.begin_step(10)
    t0 = state.step_t0
    assert t0 is not None
    mark = STALL_BEAT_FACTOR * 0.2
    assert not state.stalled(t0 + mark - 0.01)
    assert state.stalled(t0 + mark + 0.01)
    assert not state.stalled(t0 + 10 * mark)  # once per step
    state.end_step(0.25)
    state.begin_step(11)
    assert state.stalled(state.step_t0 + mark + 0.1)  # type: ignore[operator]


def test_short_steps_wait_at_least_the_minimum() -> None:
    state = stepped([0.01] * 10)
    state.begin_step(10)
    t0 = state.step_t0
    assert t0 is not None
    assert not state.stalled(t0 + STALL_BEAT_MIN_S - 0.01)
    assert state.stalled(t0 + STALL_BEAT_MIN_S + 0.01)


def test_the_usual_step_follows_the_steps_without_jumping_on_one_slow_step() -> None:
    state = stepped([0.1] * 30 + [5.0])
    assert state.usual_step is not None and 0.5 < state.usual_step < 0.7


def test_trainguards_own_collective_reads_as_a_wait_and_counts() -> None:
    identity = resolve_identity("j", 0, 2, "node-a", env={})
    state = stepped([0.1] * 3)  # between steps: the phase is None
    assert state.heartbeat(identity, 0).phase is None
    with state.collective():
        beat = state.heartbeat(identity, 0)
        assert beat.phase == "comm" and (beat.coll_seq, beat.coll_done) == (1, 0)
    beat = state.heartbeat(identity, 0)
    assert beat.phase is None and (beat.coll_seq, beat.coll_done) == (1, 1)
