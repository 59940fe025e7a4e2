"""Leases in Redis: a key that names its holder and expires unless the holder renews it.

Two services hold them: the detector, one lease per job it owns (so several detectors split
the jobs), and the remediator, one leader lock whose holder alone acts. A lease is taken
with ``SET NX PX``; it is renewed and released only while it still names the holder
(compare and act in one Lua script, so a lease that expired and went to someone else is
never extended or deleted by its old holder). Writes to shared state can be fenced by a
lease: the script checks the lease and writes in one step, so a holder that lost it writes
nothing. What to hold and what follows from holding it (which jobs; a new fencing epoch for
a leader) is each service's own policy.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import redis.asyncio as aioredis

_TAKE = """
local holder = redis.call('GET', KEYS[1])
if holder == false then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
if holder == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

_TAKE_FROM = """
local holder = redis.call('GET', KEYS[1])
if holder == false or holder == ARGV[2] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
  return 1
end
return 0
"""

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

_FENCED_HSET = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
return 1
"""

_FENCED_HSET_TRACK = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
if ARGV[5] == '1' then redis.call('SADD', KEYS[3], ARGV[4])
else redis.call('SREM', KEYS[3], ARGV[4]) end
return 1
"""

_FENCED_HWRITE = """
local holder = redis.call('GET', KEYS[1])
if holder ~= ARGV[1] then return holder or '' end
for i = 2, #ARGV, 3 do
  if ARGV[i] == 'd' then redis.call('HDEL', KEYS[2], ARGV[i + 1])
  else redis.call('HSET', KEYS[2], ARGV[i + 1], ARGV[i + 2]) end
end
return 1
"""

_FENCED_HDEL_IF = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
if redis.call('HGET', KEYS[2], ARGV[2]) ~= ARGV[3] then return 0 end
return redis.call('HDEL', KEYS[2], ARGV[2])
"""


class LeaseHolder:
    """The leases one holder takes, renews and releases, and the writes they fence.

    ``holder`` is the value stored under each lease key (an instance name or a random
    token): whoever reads the key learns the owner. Operations on several leases are
    pipelined, one round trip each.
    """

    def __init__(self, redis: aioredis.Redis, holder: str, ttl: float) -> None:
        self.redis = redis
        self.holder = holder
        self.ttl = ttl
        self.ttl_ms = max(1, int(ttl * 1000))

    async def acquire(self, key: str) -> bool:
        """Take the lease on ``key`` if nobody holds it."""
        return bool(await self.redis.set(key, self.holder, nx=True, px=self.ttl_ms))

    async def take(self, key: str) -> bool:
        """Take the lease on ``key`` if nobody holds it *or it already names this holder*.

        For holders with a stable name: a holder that restarted (its old process died
        still holding the lease) takes its own lease back at once instead of waiting for
        it to expire. A holder whose name is a fresh token per process gains nothing over
        :meth:`acquire`; one whose name two live processes share must not use it.
        """
        return bool(await self.redis.eval(_TAKE, 1, key, self.holder, self.ttl_ms))

    async def take_from(self, key: str, previous: str) -> bool:
        """Take the lease on ``key`` if it is free or still names ``previous``: a holder
        known to be gone (:mod:`trainguard.runtime.presence`) is not waited out. A lease
        ``previous`` renewed under another's name meanwhile is left alone."""
        return bool(await self.redis.eval(_TAKE_FROM, 1, key, self.holder, previous,
                                          self.ttl_ms))

    async def renew(self, keys: Iterable[str]) -> set[str]:
        """Extend the leases on ``keys``; returns those this holder no longer has."""
        keys = list(keys)
        if not keys:
            return set()
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.eval(_RENEW, 1, key, self.holder, self.ttl_ms)
        results = await pipe.execute()
        return {key for key, ok in zip(keys, results, strict=True) if not ok}

    async def release(self, keys: Iterable[str]) -> None:
        """Give the leases on ``keys`` up at once (those still ours), so others need not
        wait for them to expire."""
        keys = list(keys)
        if not keys:
            return
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.eval(_RELEASE, 1, key, self.holder)
        await pipe.execute()

    async def owners(self, keys: Iterable[str]) -> dict[str, str | None]:
        """Who holds each lease (None: free)."""
        keys = list(keys)
        if not keys:
            return {}
        values = await self.redis.mget(keys)
        return {key: v.decode() if isinstance(v, bytes) else v
                for key, v in zip(keys, values, strict=True)}

    async def hwrite(self, writes: Iterable[tuple[str, str, Mapping[str, str | None]]]
                     ) -> list[str | None]:
        """For each ``(lease, key, fields)``: set each field of hash ``key`` (None: delete
        it) only while ``lease`` is ours, all of them in one step. Per write, None when
        written, else who holds the lease ("" when nobody). One round trip."""
        writes = list(writes)
        if not writes:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for lease, key, fields in writes:
            args: list[str] = []
            for field, value in fields.items():
                args += ["d", field, ""] if value is None else ["s", field, value]
            pipe.eval(_FENCED_HWRITE, 2, lease, key, self.holder, *args)
        out: list[str | None] = []
        for result in await pipe.execute():
            if result == 1:
                out.append(None)
            else:
                out.append(result.decode() if isinstance(result, bytes) else str(result))
        return out

    async def hset(self, lease: str, key: str, field: str, value: str | bytes) -> bool:
        """``HSET key field value`` only while ``lease`` is ours; False: nothing written."""
        written = await self.redis.eval(_FENCED_HSET, 2, lease, key, self.holder, field, value)
        return bool(written == 1)

    async def hset_tracked(self, lease: str, key: str, field: str, value: str | bytes,
                           members: str, member: str, present: bool) -> bool:
        """Like :meth:`hset`, and in the same step add ``member`` to the set ``members``
        (``present``) or remove it, so an index never disagrees with the hash."""
        written = await self.redis.eval(_FENCED_HSET_TRACK, 3, lease, key, members,
                                        self.holder, field, value, member,
                                        "1" if present else "0")
        return bool(written == 1)

    async def hdel_if(self, lease: str, key: str, field: str, expected: str | bytes) -> bool | None:
        """``HDEL key field`` only while ``lease`` is ours and the field still holds
        ``expected`` (nobody rewrote it meanwhile). None: the lease is lost; False: the
        value changed, nothing deleted."""
        done = await self.redis.eval(_FENCED_HDEL_IF, 2, lease, key, self.holder, field,
                                     expected)
        return None if done == -1 else bool(done)
