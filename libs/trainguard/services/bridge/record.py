"""What the bridge sent, in Redis: the dedupe record that survives a restart.

``bridge:sent:<job>`` is a hash, incident id → :class:`~.rules.Sent` (JSON), kept a week
after its last change; ``bridge:firing`` is the set of ``<job>|<id>`` whose alert
Alertmanager must keep hearing about (re-posted every ``repeat_s``).
"""

from __future__ import annotations

from typing import Final

import msgspec
import redis.asyncio as aioredis

from .rules import Sent

KEEP_S: Final = 7 * 86400


class SentRecords:
    def __init__(self, redis: aioredis.Redis, prefix: str) -> None:
        self.redis = redis
        self.prefix = prefix
        self.firing_key = f"{prefix}:bridge:firing"

    def _key(self, job: str) -> str:
        return f"{self.prefix}:bridge:sent:{job}"

    async def load(self, job: str, incident: str) -> Sent | None:
        raw = await self.redis.hget(self._key(job), incident)
        if raw is None:
            return None
        return msgspec.json.decode(raw, type=Sent)

    async def save(self, sent: Sent, *, firing: bool) -> None:
        """Store ``sent``; ``firing``: keep re-posting its alert."""
        key = self._key(sent.job)
        member = f"{sent.job}|{sent.incident}"
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(key, sent.incident, msgspec.json.encode(sent))
        pipe.expire(key, KEEP_S)
        if firing:
            pipe.sadd(self.firing_key, member)
        else:
            pipe.srem(self.firing_key, member)
        await pipe.execute()

    async def firing(self) -> list[tuple[str, str]]:
        members = await self.redis.smembers(self.firing_key)
        out = []
        for m in members:
            job, _, ident = (m.decode() if isinstance(m, bytes) else str(m)).partition("|")
            out.append((job, ident))
        return sorted(out)

    async def stop_firing(self, job: str, incident: str) -> None:
        await self.redis.srem(self.firing_key, f"{job}|{incident}")
