"""One acting remediator: a Redis lock with a fencing token.

The holder renews the lock every ``ttl / 4``; a replica takes over within ``ttl`` of the
holder's death. Each new holder draws a fresh epoch (INCR), carried on every command so
agents and ranks reject a deposed leader's late commands, and checked inside the Lua
scripts that write shared state (blocklist, incidents), so a deposed leader writes nothing.
"""

from __future__ import annotations

import uuid

import redis.asyncio as aioredis

from trainguard.state import Keys

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

_FENCED_HSET = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
return 1
"""

_FENCED_HSET_SADD = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
if ARGV[5] == '1' then redis.call('SADD', KEYS[3], ARGV[4])
else redis.call('SREM', KEYS[3], ARGV[4]) end
return 1
"""


class NotLeader(Exception):
    """A fenced write refused: this replica no longer holds the lock."""


class Leadership:
    def __init__(self, redis: aioredis.Redis, keys: Keys, role: str = "remediator",
                 ttl: float = 3.0) -> None:
        self.redis = redis
        self.keys = keys
        self.role = role
        self.ttl_ms = int(ttl * 1000)
        self.token = f"{uuid.uuid4().hex}"
        self.epoch = 0
        self.leading = False

    async def tick(self) -> bool:
        """Renew or try to take the lock; returns whether this replica leads now."""
        key = self.keys.leader(self.role)
        if self.leading:
            renewed = await self.redis.eval(_RENEW, 1, key, self.token, str(self.ttl_ms))
            if renewed:
                return True
            self.leading = False
        if await self.redis.set(key, self.token, nx=True, px=self.ttl_ms):
            self.epoch = int(await self.redis.incr(self.keys.epoch(self.role)))
            self.leading = True
        return self.leading

    async def release(self) -> None:
        if self.leading:
            await self.redis.eval("if redis.call('GET', KEYS[1]) == ARGV[1] then "
                                  "return redis.call('DEL', KEYS[1]) end return 0", 1,
                                  self.keys.leader(self.role), self.token)
            self.leading = False

    async def hset(self, key: str, field: str, value: str | bytes) -> None:
        ok = await self.redis.eval(_FENCED_HSET, 2, self.keys.leader(self.role), key,
                                   self.token, field, value)
        if ok != 1:
            self.leading = False
            raise NotLeader(f"lost the {self.role} lock; write to {key} refused")

    async def save_incident(self, key: str, field: str, value: str | bytes, open_key: str,
                            member: str, is_open: bool) -> None:
        ok = await self.redis.eval(_FENCED_HSET_SADD, 3, self.keys.leader(self.role), key,
                                   open_key, self.token, field, value, member,
                                   "1" if is_open else "0")
        if ok != 1:
            self.leading = False
            raise NotLeader(f"lost the {self.role} lock; incident write refused")
