"""Real servers for the whole test session: nats-server and redis-server from the wheels.

They listen on free loopback ports and are stopped by PID at the end. Tests isolate from
each other by a unique subject prefix (hence their own streams) and unique job names,
never by mocks.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from trainguard.runtime.embedded import EmbeddedControlPlane, NatsServer, RedisServer, free_port

T = TypeVar("T")

pytest_plugins = ["tests.ha"]  # the NATS cluster and Sentinel fixtures


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedControlPlane]:
    plane = EmbeddedControlPlane(tmp_path_factory.mktemp("control-plane"))
    plane.start()
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def nats_url(control_plane: EmbeddedControlPlane) -> str:
    return control_plane.nats.url


@pytest.fixture(scope="session")
def redis_url(control_plane: EmbeddedControlPlane) -> str:
    return control_plane.redis.url


@pytest.fixture
def prefix() -> str:
    """A subject prefix of the test's own: its streams and keys touch no other test."""
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture
def job() -> str:
    return "job-" + uuid.uuid4().hex[:8]


@pytest.fixture
def private_nats(tmp_path: Path) -> Iterator[NatsServer]:
    """A nats-server this test alone may kill and restart."""
    server = NatsServer(free_port(), tmp_path / "nats")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server this test alone may stop and restart."""
    server = RedisServer(free_port(), tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def wait_until(cond: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02,
                     what: str | Callable[[], str] = "condition") -> Any:
    """Poll ``cond`` (sync or async) until it returns something truthy, or fail.
    ``what`` may be a callable: the failure then says what was seen at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if isinstance(value, Awaitable):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            said = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {said}")
        await asyncio.sleep(interval)


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[Any]:
    import nats

    client = await nats.connect(nats_url)
    try:
        yield client
    finally:
        await client.close()
