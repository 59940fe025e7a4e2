"""The agent's warm-spare pool with real spare processes: one warms up at a time."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainguard.agent.spares import SparePool

READY_TIMEOUT = 180.0  # torch's import on a loaded 2-core machine


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[SparePool]:
    p = SparePool(2, os.environ, str(tmp_path))
    yield p
    p.close()


def _fill_until(pool: SparePool, ready: int) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while len(pool.ready_pids()) < ready:
        assert time.monotonic() < deadline, f"{ready} spares not ready in {READY_TIMEOUT} s"
        pool.fill()
        time.sleep(0.1)  # the supervisor's own polling cadence, scaled down


def test_spares_warm_up_one_at_a_time(pool: SparePool) -> None:
    pool.fill()
    pool.fill()  # the first is still importing torch: no second one yet
    assert pool.started_total == 1
    _fill_until(pool, 1)
    pool.fill()
    assert pool.started_total == 2, "a ready pool below its size starts the next spare"
    _fill_until(pool, 2)
    pool.fill()
    assert pool.started_total == 2, "a full pool starts nothing"
    assert len(set(pool.ready_pids())) == 2


def test_a_dead_spare_is_replaced(pool: SparePool) -> None:
    _fill_until(pool, 2)
    victim = pool.ready_pids()[0]
    os.kill(victim, 9)
    deadline = time.monotonic() + READY_TIMEOUT
    while victim in pool.ready_pids():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    _fill_until(pool, 2)
    assert victim not in pool.ready_pids() and pool.started_total == 3
