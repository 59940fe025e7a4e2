"""Redis access shared by the services: one client, retries with backoff, clear errors.

Commands retry on connection errors with exponential backoff for a few seconds, which
covers a Redis restart or failover. A Sentinel URL (:mod:`trainguard.runtime.redisurl`) gives a
client that asks the sentinels where the primary is on every new connection, so after a
failover the retries reach the promoted replica (a demoted primary's READONLY answer
counts as a connection error). Beyond that the error reaches the handler, and the
service base settles the message with a delayed redelivery (never a dead letter), so
nothing that was acknowledged on the bus is lost while Redis is away.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialBackoff
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from trainguard.contract.errors import TrainguardError

from .redisurl import is_sentinel_url, parse_sentinel_url

TRANSIENT_REDIS_ERRORS: tuple[type[Exception], ...] = (RedisConnectionError, RedisTimeoutError)
PERMANENT_REDIS_ERRORS: tuple[type[Exception], ...] = (AuthenticationError,)
"""Raised as connection errors, but no retry mends them: wrong credentials."""


class StoreUnavailable(TrainguardError, ConnectionError):
    """Redis did not answer the first ping within its bound."""


def redis_client(url: str, *, retries: int = 8,
                 access: Mapping[str, Any] | None = None) -> aioredis.Redis:
    """A client whose commands retry transient failures (8 retries: about 5 s in all).

    ``access``: credentials and TLS options (:meth:`trainguard.core.auth.Access.redis_options`).
    """
    backoff = ExponentialBackoff(cap=1.0, base=0.05)
    options: dict[str, Any] = {
        **(access or {}),
        "decode_responses": True,
        "socket_connect_timeout": 1.0,
        "socket_timeout": 5.0,
        "retry": Retry(backoff, retries),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
        "health_check_interval": 10,
    }
    if is_sentinel_url(url):
        return _sentinel_client(url, options)
    return aioredis.Redis.from_url(url, **options)


class SentinelRedis(aioredis.Redis):
    """A client of the primary that Sentinel names; closing it closes the sentinel clients
    too (redis-py leaves them open)."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        pool = self.connection_pool
        manager = getattr(pool, "sentinel_manager", None)
        for sentinel in getattr(manager, "sentinels", ()):
            await sentinel.aclose()


def _sentinel_client(url: str, options: dict[str, Any]) -> aioredis.Redis:
    target = parse_sentinel_url(url)
    tls = {k: v for k, v in options.items() if k.startswith("ssl_")}
    sentinel_options: dict[str, Any] = {
        "socket_connect_timeout": options["socket_connect_timeout"],
        "socket_timeout": options["socket_timeout"], "decode_responses": True,
        "username": target.username, "password": target.password,
        **({"ssl": True, **tls} if target.tls else {}),
    }
    sentinel = Sentinel(list(target.sentinels), sentinel_kwargs=sentinel_options)
    node_options: dict[str, Any] = {**options, "db": target.db}
    if target.tls:
        node_options["ssl"] = True
    client: SentinelRedis = sentinel.master_for(target.master, redis_class=SentinelRedis,
                                                **node_options)
    return client


async def connect_redis(url: str, *, timeout: float = 5.0,
                        access: Mapping[str, Any] | None = None) -> aioredis.Redis:
    """A client that has answered one PING, so a wrong URL or password fails at start."""
    client = redis_client(url, access=access)
    try:
        await asyncio.wait_for(client.ping(), timeout)
    except (AuthenticationError, NoPermissionError, ResponseError) as exc:
        await client.aclose()
        raise StoreUnavailable(
            f"Redis at {url} refused this client ({exc}); give the role's credentials with "
            "TRAINGUARD_CREDENTIALS (see `trainguard credentials`)") from None
    except (TimeoutError, RedisConnectionError, RedisTimeoutError, OSError) as exc:
        await client.aclose()
        raise StoreUnavailable(
            f"cannot reach Redis at {url} within {timeout:.0f}s ({exc!r}); is redis-server "
            "running? `trainguard up` starts one, or pass --redis / TRAINGUARD_REDIS_URL"
        ) from None
    return client
