"""Lanes: one key's items in order, different keys' at once, a bound on items in hand."""

from __future__ import annotations

import asyncio

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
