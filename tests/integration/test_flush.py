"""Flushing against a real nats-server that stops answering for a while (SIGSTOP): a flush
that gives up must leave the connection receiving once the server is back. nats-py's own
``flush(timeout)`` does not (its late PONG ends the read loop for good while the client says
it is connected); :func:`trainguard.core.connection.flush` does."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import nats
import pytest

from tests.conftest import wait_until
from trainguard.core.connection import flush
from trainguard.runtime.embedded import NatsServer


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0] == "T"


async def received_after_a_flush_timeout(server: NatsServer,
                                         flush_: Callable[[Any], Awaitable[None]]) -> bool:
    listener, talker = await nats.connect(server.url), await nats.connect(server.url)
    got: list[bytes] = []

    async def on(msg: Any) -> None:
        got.append(msg.data)

    try:
        await listener.subscribe("t", cb=on)
        await flush(listener)
        assert server.pid is not None
        os.kill(server.pid, signal.SIGSTOP)
        await wait_until(lambda: stopped(server.pid), what="the server stopped")
        try:
            with pytest.raises(TimeoutError):
                await flush_(listener)
        finally:
            os.kill(server.pid, signal.SIGCONT)
        await flush(talker)  # the server answers again
        await asyncio.sleep(0)
        for _ in range(50):  # the late PONG has been read by now
            await talker.publish("t", b"after")
            await flush(talker)
            try:
                await wait_until(lambda: got, timeout=0.1, what="a message")
                return True
            except AssertionError:
                continue
        return listener.is_connected and bool(got)
    finally:
        await listener.close()
        await talker.close()


async def test_a_flush_that_timed_out_leaves_the_connection_receiving(
        private_nats: NatsServer) -> None:
    assert await received_after_a_flush_timeout(private_nats, lambda nc: flush(nc, 0.3))


async def test_nats_pys_own_flush_timeout_stops_receiving(private_nats: NatsServer) -> None:
    """The reason :func:`flush` exists: if this ever passes no more, nats-py fixed it."""
    assert not await received_after_a_flush_timeout(private_nats,
                                                     lambda nc: nc.flush(timeout=0.3))


async def test_a_subscription_is_in_place_once_flush_returns(private_nats: NatsServer) -> None:
    """nats-py writes a flush's PING ahead of a SUB still queued for its flusher task, so its
    PONG can come back before the server has the subscription (seen on a busy machine: a
    message published from another connection right after was never delivered)."""
    listener = await nats.connect(private_nats.url)
    talker = await nats.connect(private_nats.url)
    got: list[str] = []

    async def on(msg: Any) -> None:
        got.append(msg.subject)

    try:
        for i in range(200):
            await listener.subscribe(f"s.{i}", cb=on)
            await flush(listener)
            await talker.publish(f"s.{i}", b"x")
        await flush(talker)
        await wait_until(lambda: len(got) == 200, what="every message", timeout=10)
        assert sorted(got) == sorted(f"s.{i}" for i in range(200))
    finally:
        await listener.close()
        await talker.close()


async def test_a_flush_returns_while_its_connection_keeps_publishing(
        private_nats: NatsServer) -> None:
    """Commands queued as each PING goes out make another round; a connection that never
    stops publishing still gets its flush answered (in a few rounds, not at the timeout)."""
    nc = await nats.connect(private_nats.url)
    stop = asyncio.Event()

    async def publish() -> None:
        while not stop.is_set():
            await nc.publish("noise", b"x" * 64)
            await asyncio.sleep(0)

    task = asyncio.create_task(publish())
    try:
        await wait_until(lambda: nc.pending_data_size > 0, what="commands queued")
        await flush(nc, 5.0)
    finally:
        stop.set()
        await task
        await nc.close()
