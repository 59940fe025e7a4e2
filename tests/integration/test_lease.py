"""Leases and fenced writes (trainguard.runtime.lease) on a real Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from tests.conftest import wait_until
from trainguard.runtime.lease import LeaseHolder


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    await client.aclose()


async def test_only_the_holder_renews_or_releases(redis: aioredis.Redis, prefix: str) -> None:
    a, b = LeaseHolder(redis, "a", ttl=5.0), LeaseHolder(redis, "b", ttl=5.0)
    one, two = f"{prefix}:lease:one", f"{prefix}:lease:two"
    assert await a.acquire(one) and not await b.acquire(one)
    assert await b.acquire(two)
    assert await a.renew([one, two]) == {two}
    await a.release([one, two])  # gives up "one"; "two" is b's and stays
    assert await a.owners([one, two]) == {one: None, two: "b"}


async def test_a_holder_with_a_stable_name_takes_its_own_lease_back(
        redis: aioredis.Redis, prefix: str) -> None:
    key = f"{prefix}:lease:job"
    before = LeaseHolder(redis, "det-a", ttl=30.0)
    assert await before.acquire(key)
    await redis.pexpire(key, 1000)  # most of its TTL has run out since
    restarted = LeaseHolder(redis, "det-a", ttl=30.0)  # same name, a new process
    assert not await restarted.acquire(key), "acquire alone would wait out the old lease"
    assert await restarted.take(key) and await redis.pttl(key) > 20_000
    assert not await LeaseHolder(redis, "det-b", ttl=30.0).take(key)
    await redis.delete(key)
    assert await LeaseHolder(redis, "det-b", ttl=30.0).take(key)


async def test_an_expired_lease_goes_to_the_next_holder(redis: aioredis.Redis,
                                                        prefix: str) -> None:
    a, b = LeaseHolder(redis, "a", ttl=0.2), LeaseHolder(redis, "b", ttl=5.0)
    key = f"{prefix}:lease:job"
    assert await a.acquire(key)
    await wait_until(lambda: b.acquire(key), timeout=5.0, what="the lease to expire")
    assert await a.renew([key]) == {key}  # a cannot extend what is b's now
    assert (await a.owners([key]))[key] == "b"


async def test_fenced_writes_need_the_lease(redis: aioredis.Redis, prefix: str) -> None:
    a, b = LeaseHolder(redis, "a", ttl=5.0), LeaseHolder(redis, "b", ttl=5.0)
    lock, table, index = f"{prefix}:leader", f"{prefix}:table", f"{prefix}:open"
    assert await a.acquire(lock)
    assert await a.hset_tracked(lock, table, "i1", "v1", index, "m1", present=True)
    assert await a.hset(lock, table, "i2", "v2")
    assert not await b.hset(lock, table, "i1", "stale")
    assert not await b.hset_tracked(lock, table, "i1", "stale", index, "m1", present=False)
    assert await redis.hgetall(table) == {"i1": "v1", "i2": "v2"}
    assert await redis.smembers(index) == {"m1"}
    assert await a.hset_tracked(lock, table, "i1", "closed", index, "m1", present=False)
    assert await redis.smembers(index) == set()
