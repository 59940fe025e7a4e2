"""Lanes: one key's items in order, different keys' at once, a bound on items in hand; and
how long a consumer's pull requests wait."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from trainguard.runtime.lanes import Lanes


async def test_one_keys_items_in_order_and_another_key_not_behind_them() -> None:
    done: list[str] = []
    gate = asyncio.Event()

    async def work(item: str) -> None:
        if item == "a0":
            await gate.wait()  # the first of lane a blocks: a1 and a2 wait behind it
        done.append(item)

    lanes: Lanes[str] = Lanes(work, lambda item: item[0], limit=10)
    for item in ("a0", "a1", "b0", "a2", "b1"):
        await lanes.put(item)
    for _ in range(5):
        await asyncio.sleep(0)
    assert done == ["b0", "b1"]
    assert lanes.busy == 1
    gate.set()
    await lanes.join()
    assert done == ["b0", "b1", "a0", "a1", "a2"]
    assert lanes.busy == 0


async def test_put_waits_while_limit_items_are_in_hand() -> None:
    gate = asyncio.Event()
    handled: list[int] = []

    async def work(item: int) -> None:
        await gate.wait()
        handled.append(item)

    lanes: Lanes[int] = Lanes(work, str, limit=2)
    await lanes.put(1)
    await lanes.put(2)
    third = asyncio.create_task(lanes.put(3))
    await asyncio.sleep(0.01)
    assert not third.done()
    gate.set()
    await asyncio.wait_for(third, 1)
    await lanes.join()
    assert sorted(handled) == [1, 2, 3]


async def test_a_lane_ends_with_its_last_item_and_a_new_one_starts_after() -> None:
    seen: list[int] = []

    async def work(item: int) -> None:
        await asyncio.sleep(0)
        seen.append(item)

    lanes: Lanes[int] = Lanes(work, lambda _: "k", limit=4)
    await lanes.put(1)
    await lanes.join()
    await lanes.put(2)
    await lanes.join()
    assert seen == [1, 2] and lanes.busy == 0


class _OneFetch:
    """A pull subscription that records each fetch's wait and ends the consumer's loop."""

    def __init__(self, stopping: asyncio.Event) -> None:
        self.stopping = stopping
        self.waits: list[float] = []

    async def fetch(self, batch: int, timeout: float) -> list[object]:
        self.waits.append(timeout)
        self.stopping.set()
        raise TimeoutError

    async def unsubscribe(self) -> None:
        pass


async def test_a_consumers_pull_requests_wait_fetch_wait_and_the_detectors_are_short(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica's pull request keeps receiving what it hands back until it expires: the
    detector's replicas, which hand each other's jobs back, wait less than the default."""
    from trainguard.runtime import service as service_module
    from trainguard.runtime.config import Settings, load_settings
    from trainguard.runtime.service import Consumer, Runtime
    from trainguard.runtime.topology import ConsumerSpec
    from trainguard.services.detector.service import DetectorService
    from trainguard.services.detector.settings import DetectorSettings

    detector = load_settings(DetectorSettings, env={}, overrides={})
    assert detector.fetch_wait < load_settings(Settings, env={}, overrides={}).fetch_wait
    rt = Runtime(DetectorService(detector), detector)
    sub = _OneFetch(rt.stopping)

    async def bind(durable: str, stream: str) -> _OneFetch:
        return sub

    async def ensure(*args: object) -> str:
        return "stream"

    monkeypatch.setattr(service_module, "ensure_consumer", ensure)
    rt._bus = SimpleNamespace(js=SimpleNamespace(pull_subscribe_bind=bind),  # type: ignore[assignment]
                              subjects=detector.subjects)
    rt._settler = SimpleNamespace(settle=None)  # type: ignore[assignment]
    spec = ConsumerSpec("reports", "detector-exit", ("x.>",))
    await rt._consume(Consumer(spec, lambda *_: asyncio.sleep(0), (), by_job=True))
    assert sub.waits == [detector.fetch_wait]
