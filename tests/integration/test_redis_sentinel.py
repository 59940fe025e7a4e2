"""Redis with Sentinel on loopback: a primary, a replica, three sentinels (``tests.ha``).

The services reach Redis through a Sentinel URL and follow a failover by themselves; the
remediator's fencing epoch never repeats across one, even a failover that loses writes
(Redis replicates asynchronously), because epochs come from the replicated NATS bucket.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from tests.conftest import wait_until
from tests.ha import SentinelSet
from trainguard.runtime.bus import connect_nats
from trainguard.runtime.fencing import Epochs, read_mirror
from trainguard.runtime.state import Keys
from trainguard.runtime.store import connect_redis
from trainguard.services.remediator.leader import Leadership


async def _replicated(client: Any) -> None:
    """WAIT until the replica has every write so far (1 replica, 5 s)."""
    assert int(await client.execute_command("WAIT", 1, 5000)) == 1


async def test_a_sentinel_client_follows_a_failover(sentinel_set: SentinelSet) -> None:
    client = await connect_redis(sentinel_set.url)
    try:
        old = sentinel_set.primary.port
        await client.set("before", "kept")
        await _replicated(client)
        sentinel_set.primary.kill()
        started = time.monotonic()
        new = await sentinel_set.wait_failover(old)
        assert new == sentinel_set.replica.port

        async def writes() -> bool:
            try:
                return bool(await client.set("after", "written"))
            except Exception:
                return False

        await wait_until(writes, timeout=30, what="a write through the new primary")
        recovered = time.monotonic() - started
        assert await client.get("before") == "kept"
        assert await client.get("after") == "written"
        print(f"redis failover: writes back {recovered:.1f}s after the primary died")
    finally:
        await client.aclose()


async def test_an_epoch_issued_before_a_failover_is_never_issued_again(
        sentinel_set: SentinelSet, nats_url: str) -> None:
    """Drive Redis into the failover that loses the last writes: the replica is frozen
    while a new leader takes the lock and draws epoch e1, then the primary dies and the
    stale replica is promoted. Redis no longer knows e1 (an ``INCR`` would hand it out
    again); the next leader still draws above it."""
    prefix = "t" + uuid.uuid4().hex[:10]
    keys = Keys(prefix)
    nc = await connect_nats(nats_url, name="test")
    redis = await connect_redis(sentinel_set.url)
    try:
        epochs = Epochs(nc.jetstream(), prefix)
        first = Leadership(redis, keys, epochs, ttl=30.0)
        assert await first.tick()
        e0 = first.epoch
        await _replicated(redis)
        await first.release()

        await sentinel_set.isolate_replica()  # from here on the primary's writes stay its own
        second = Leadership(redis, keys, epochs, ttl=30.0)
        assert await second.tick()
        e1 = second.epoch
        assert e1 > e0
        assert await read_mirror(redis, keys.epoch("remediator")) == e1
        old = sentinel_set.primary.port
        sentinel_set.primary.kill()
        sentinel_set.replica.thaw()
        assert await sentinel_set.wait_failover(old) == sentinel_set.replica.port

        async def mirror() -> int | None:
            try:
                return await read_mirror(redis, keys.epoch("remediator"))
            except Exception:
                return None

        lost = await wait_until(mirror, timeout=30,
                                what="Redis answering after the failover")
        # The failover lost the lock and e1: the old INCR would have drawn e1 again.
        assert lost == e0 and lost + 1 == e1
        assert await redis.get(keys.leader("remediator")) is None

        third = Leadership(redis, keys, epochs, ttl=30.0)
        assert await third.tick()
        assert third.epoch > e1
        assert not await second.tick()  # deposed: its lock is gone and the third holds it
        assert await read_mirror(redis, keys.epoch("remediator")) == third.epoch
    finally:
        await redis.aclose()
        await nc.close()

