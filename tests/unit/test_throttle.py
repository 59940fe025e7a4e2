"""The newest of a stream of reports, at most one per interval (``trainguard.client.throttle``):
what a rank taking a memory snapshot every step sends to the bus."""

from __future__ import annotations

import itertools

import pytest

from trainguard.client.throttle import Latest


def test_the_first_goes_at_once_and_the_newest_of_the_rest_once_the_interval_is_over() -> None:
    t = Latest[int](1.0)
    assert t.offer(1, now=10.0) == 1
    assert t.due(10.5) is None  # nothing held
    for item, now in ((2, 10.1), (3, 10.4), (4, 10.9)):
        assert t.offer(item, now) is None
    assert t.held == 4 and t.suppressed == 2
    assert t.due(10.95) is None  # the interval is not over
    assert t.due(11.0) == 4  # the newest, and it counts as sent now
    assert t.due(12.5) is None
    assert t.offer(5, now=11.5) is None  # within a second of the held one's going out
    assert t.due(12.0) == 5


def test_at_most_one_per_interval_for_a_report_every_step() -> None:
    t = Latest[int](1.0)
    sent: list[tuple[float, int]] = []
    for step in range(100):  # 20 steps a second, a due check every 0.25 s
        now = step * 0.05
        out = t.offer(step, now)
        if out is not None:
            sent.append((now, out))
        if step % 5 == 0 and (out := t.due(now)) is not None:
            sent.append((now, out))
    times = [now for now, _ in sent]
    assert all(b - a >= 1.0 - 1e-9 for a, b in itertools.pairwise(times))
    assert 4 <= len(sent) <= 6
    assert [s for _, s in sent] == sorted(s for _, s in sent)  # never an older after a newer
    assert t.flush() == 99 and t.flush() is None  # on the way out: the newest, whenever


def test_a_long_pause_lets_the_next_go_at_once() -> None:
    t = Latest[str](1.0)
    assert t.offer("a", 0.0) == "a"
    assert t.offer("b", 5.0) == "b"
    with pytest.raises(ValueError, match="interval"):
        Latest[str](-1.0)
