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


class Counted(str):
    """A responder that counts how often the box reads which host it names."""

    reads = 0

    def removeprefix(self, prefix: str, /) -> str:
        Counted.reads += 1
        return str(self).removeprefix(prefix)


async def test_each_ack_of_a_group_command_is_read_a_bounded_number_of_times() -> None:
    """2,048 agents answer one ``cmd.all``, each ack on its own turn of the loop (as acks
    from separate reads of the socket come): the sender's bookkeeping reads each ack a
    bounded number of times, not all those before it again on every arrival."""
    hosts = [f"node-{h}" for h in range(2048)]
    box = AckBox()
    Counted.reads = 0
    waiting = asyncio.create_task(box.collect("c", hosts, 60.0))
    await asyncio.sleep(0)
    for host in hosts:
        box.add(CommandAck(job="j", command_id="c", responder=Counted(f"host-{host}"),
                           outcome="done"))
        await asyncio.sleep(0)  # the sender may look at what came
    got = await asyncio.wait_for(waiting, 5.0)
    assert len(got) == len(hosts)
    assert Counted.reads <= 2 * len(hosts)


async def test_collect_ends_when_every_named_host_answered() -> None:
    box = AckBox()
    box.add(ack("c", "host-node-a"))  # before the wait
    waiting = asyncio.create_task(box.collect("c", {"node-a", "node-b", "node-c"}, 30.0))
    await asyncio.sleep(0)
    box.add(ack("c", "host-node-a"))  # again (a retry's answer): still two to hear
    box.add(ack("c", "host-stranger"))  # not awaited: changes nothing
    box.add(ack("c", "host-node-b"))
    await asyncio.sleep(0)
    assert not waiting.done()
    box.add(ack("c", "host-node-c"))
    got = await asyncio.wait_for(waiting, 5.0)
    assert [a.responder for a in got] == ["host-node-a", "host-node-a", "host-stranger",
                                          "host-node-b", "host-node-c"]


async def test_collect_without_named_hosts_takes_the_first_answer_or_times_out() -> None:
    box = AckBox()
    assert await box.collect("none", (), 0.0) == []
    waiting = asyncio.create_task(box.collect("c", (), 30.0))
    await asyncio.sleep(0)
    box.add(ack("c"))
    assert [a.responder for a in await asyncio.wait_for(waiting, 5.0)] == ["node-a"]
    assert await box.collect("silent", {"node-a"}, 0.01) == []
