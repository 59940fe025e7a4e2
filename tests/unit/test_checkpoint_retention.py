"""Retention: newest K committed good ones, the pointer and the pin stay; nothing uncommitted
is ever a candidate."""

from __future__ import annotations

import pytest

from trainguard.contract.errors import ConfigError
from trainguard.services.checkpointer.retention import Entry, expire
from trainguard.services.checkpointer.settings import CheckpointerSettings


def committed(*steps: int) -> list[Entry]:
    return [Entry(s, "committed", False) for s in steps]


def test_keeps_the_newest_k() -> None:
    assert expire(committed(10, 20, 30, 40, 50), 3) == [20, 10]


def test_pin_and_pointer_are_kept_beyond_k() -> None:
    assert expire(committed(10, 20, 30, 40, 50), 2, pin=20, pointer=10) == [30]


def test_pending_and_failed_are_never_candidates() -> None:
    entries = [*committed(40, 50), Entry(30, "pending", False), Entry(20, "failed", False),
               Entry(10, "deleted", False)]
    assert expire(entries, 1) == [40]


def test_suspects_newer_than_the_kept_stay_as_evidence() -> None:
    entries = [Entry(60, "committed", True), Entry(50, "committed", True),
               *committed(40, 30, 20), Entry(5, "committed", True)]
    assert expire(entries, 2) == [20, 5]


def test_all_suspect_keeps_everything() -> None:
    assert expire([Entry(s, "committed", True) for s in (1, 2, 3)], 1) == []


def test_already_expired_only_listed_for_deletion() -> None:
    entries = [*committed(30, 40), Entry(20, "committed", False, retained=False)]
    assert expire(entries, 1) == [30]
    assert expire(entries, 1, include_expired=True) == [30, 20]


def test_settings_refuse_nonsense() -> None:
    with pytest.raises(ConfigError, match="verify"):
        CheckpointerSettings(verify="crc")
    with pytest.raises(ConfigError, match="interval"):
        CheckpointerSettings(interval_min=100, interval_max=10)
    with pytest.raises(ConfigError, match="retain"):
        CheckpointerSettings(retain=0)


def test_the_base_of_a_kept_increment_stays() -> None:
    chain = [Entry(10, "committed", False), Entry(11, "committed", False, base=10),
             Entry(12, "committed", False, base=10)]
    assert expire(chain, 1) == [11]  # 12 is kept, and reads 10
    # A new full save frees the old chain; an expired increment no longer holds its base.
    assert expire([Entry(20, "committed", False), *chain], 1) == [12, 11, 10]
    assert expire([Entry(20, "committed", False), *chain], 1, pointer=11) == [12]
    # Suspect evidence is kept with its base; a failed increment holds nothing.
    assert expire([Entry(22, "committed", True, base=10), Entry(20, "committed", False),
                   Entry(10, "committed", False)], 1) == []
    assert expire([Entry(20, "committed", False), Entry(12, "failed", False, base=10),
                   Entry(10, "committed", False)], 1) == [10]
