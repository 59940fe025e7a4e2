"""The remediator's ack box: acks that come before the wait are kept for it; those nobody
collects (a standby hears the leader's, a late one follows its wait) are bounded by age
and count, and a command someone waits for keeps its acks whatever their age."""

from __future__ import annotations

import asyncio

from trainguard.contract.schemas import CommandAck
from trainguard.services.remediator.acks import AckBox


def ack(ident: str, host: str = "node-a") -> CommandAck:
    return CommandAck(job="j", command_id=ident, responder=host, outcome="done")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_an_ack_before_the_wait_is_collected() -> None:
    box = AckBox()
    box.add(ack("c1"))
    assert [a.responder for a in await box.collect("c1", {"node-a"}, 1.0)] == ["node-a"]
    assert len(box) == 0


def test_uncollected_acks_are_bounded_by_count() -> None:
    box = AckBox(max_commands=100)
    for i in range(5_000):  # a standby hearing the leader's acks for weeks
        box.add(ack(f"c{i}"))
    assert len(box) == 100


async def test_uncollected_acks_age_out_but_not_while_waited_for() -> None:
    clock = Clock()
    box = AckBox(keep_s=60.0, clock=clock)
    box.add(ack("old"))
    waiting = asyncio.create_task(box.collect("slow", {"node-a", "node-b"}, 30.0))
    await asyncio.sleep(0)  # the wait has begun
    box.add(ack("slow", "node-a"))
    clock.now = 120.0
    box.add(ack("new"))
    assert len(box) == 2  # "old" went; "slow" stays while its sender waits
    box.add(ack("slow", "node-b"))
    assert sorted(a.responder for a in await waiting) == ["node-a", "node-b"]
    assert len(box) == 1
