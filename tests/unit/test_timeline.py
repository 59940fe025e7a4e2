"""A group restart's timeline (:mod:`trainguard.contract.timeline`): the agent's stamps
through the environment, and the phases the restarted group's rank 0 reports."""

from __future__ import annotations

import pytest

from trainguard.contract import timeline
from trainguard.contract.timeline import RestartStamps

T = 1_800_000_000.0


def stamps() -> RestartStamps:
    return RestartStamps(seen=T, decided=T + 0.01, stopped=T + 0.51, formed=T + 1.51,
                         warm=2, ranks=2)


def test_the_phases_are_consecutive_from_the_failure_to_the_first_step() -> None:
    phases = timeline.restart_phases(stamps(), ready=T + 3.51, loaded=T + 4.01,
                                     first_step=T + 4.11)
    assert list(phases) == list(timeline.RESTART_PHASES)
    assert phases == pytest.approx({"decision": 0.01, "stop": 0.5, "rendezvous": 1.0,
                                    "spawn": 2.0, "load": 0.5, "first_step": 0.1})
    assert sum(phases.values()) == pytest.approx(4.11)


def test_without_the_agents_stamps_the_rank_says_what_it_knows() -> None:
    phases = timeline.restart_phases(None, ready=T, loaded=T + 0.5, first_step=T + 0.4)
    assert phases == pytest.approx({"load": 0.5, "first_step": 0.0})  # a clock step: 0


def test_the_stamps_cross_the_environment_and_bad_ones_are_dropped() -> None:
    text = timeline.encode_stamps(stamps())
    assert timeline.decode_stamps(text) == stamps()
    for bad in (None, "", "{", '{"seen": 1}', text.replace(str(T), "-1.0", 1),
                '{"seen": NaN}', '"stamps"'):
        assert timeline.decode_stamps(bad) is None, bad
