"""Fencing epochs that never repeat, even across a Redis failover.

A leader's epoch rides on every command it sends; receivers keep the highest and refuse
lower ones, so a deposed leader's late commands do nothing. That only holds if no two
leaders ever get the same epoch. An ``INCR`` on a Redis primary does not promise it:
replication is asynchronous, so a failover can promote a replica that never saw the last
increment, and the next leader draws the same number again.

Epochs are drawn here instead, from a JetStream key-value bucket (``<PREFIX>_FENCE``, with
``TRAINGUARD_STREAM_REPLICAS`` copies): a draw is a compare-and-set of the role's counter
(``update(last=revision)``), acknowledged only once a quorum of the bucket's Raft group
stored it. A new stream leader has every acknowledged write, and two contenders cannot both
win the same revision, so every epoch drawn is above every epoch drawn before.

Redis keeps a mirror (``epoch:<role>``, raised only, never lowered) for the readers that
only speak Redis (the agent's ceiling on admitted epochs, the coordinator's commands);
the leader re-raises it on every renewal, so a failover that lost it heals within a tick.
"""

from __future__ import annotations

import dataclasses
from typing import Final

import redis.asyncio as aioredis
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from trainguard.contract.errors import TrainguardError
from trainguard.contract.subjects import bucket_name

DRAW_ATTEMPTS: Final = 16
"""Compare-and-set rounds before giving up (each lost round means another contender drew)."""

_RAISE = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
local wanted = tonumber(ARGV[1])
if wanted > current then redis.call('SET', KEYS[1], ARGV[1]) return wanted end
return current
"""


class EpochContended(TrainguardError):
    """Every compare-and-set round was lost to other contenders."""


class Epochs:
    """Draws fencing epochs from the replicated bucket; the bucket is made on first use."""

    def __init__(self, js: JetStreamContext, prefix: str, replicas: int = 1) -> None:
        self.js = js
        self.bucket = bucket_name(prefix)
        self.replicas = replicas
        self._kv: KeyValue | None = None

    async def kv(self, *, create: bool = True) -> KeyValue:
        """The bucket, created (or scaled to ``replicas``) where needed; ``create=False``:
        only bound (a reader: ``BucketNotFoundError`` when it does not exist)."""
        if self._kv is None and not create:
            self._kv = await self.js.key_value(self.bucket)
        if self._kv is None:
            try:
                self._kv = await self.js.key_value(self.bucket)
            except BucketNotFoundError:
                self._kv = await self.js.create_key_value(js_api.KeyValueConfig(
                    bucket=self.bucket, history=1, replicas=self.replicas,
                    storage=js_api.StorageType.FILE,
                    description="trainguard fencing epochs (one counter per leader role)"))
            stream = f"KV_{self.bucket}"
            config = (await self.js.stream_info(stream)).config
            if config.num_replicas != self.replicas:
                await self.js.update_stream(dataclasses.replace(config,
                                                                num_replicas=self.replicas))
        return self._kv

    async def current(self, role: str, *, create: bool = True) -> int:
        """The newest epoch drawn for ``role`` (0: none yet, or no bucket yet when only
        reading: no leader has drawn one)."""
        try:
            kv = await self.kv(create=create)
        except BucketNotFoundError:
            return 0
        try:
            return int((await kv.get(role)).value or b"0")
        except KeyNotFoundError:
            return 0

    async def draw(self, role: str, floor: int = 0) -> int:
        """A new epoch for ``role``, above every one drawn before and above ``floor`` (the
        Redis counter of a deployment that drew epochs with ``INCR`` before)."""
        kv = await self.kv()
        for _ in range(DRAW_ATTEMPTS):
            try:
                entry = await kv.get(role)
                current, revision = int(entry.value or b"0"), entry.revision
            except KeyNotFoundError:
                current, revision = 0, 0
            epoch = max(current, floor) + 1
            try:
                await kv.update(role, str(epoch).encode(), last=revision)
            except KeyWrongLastSequenceError:
                continue  # another contender drew in between (or our read was stale)
            return epoch
        raise EpochContended(f"no {role} epoch drawn after {DRAW_ATTEMPTS} rounds")


async def raise_mirror(redis: aioredis.Redis, key: str, epoch: int) -> int:
    """Raise the Redis mirror ``key`` to ``epoch`` (never lower it); returns its value."""
    return int(await redis.eval(_RAISE, 1, key, str(epoch)))


async def read_mirror(redis: aioredis.Redis, key: str) -> int:
    value = await redis.get(key)
    return int(value or 0)
