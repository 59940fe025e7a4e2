"""A small service used to test the service base against real servers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

import redis.exceptions

from trainguard.contract.errors import Reject
from trainguard.contract.schemas import Anomaly
from trainguard.runtime.config import Settings, load_settings
from trainguard.runtime.service import Consumer, Delivery, Runtime, Service, run_service
from trainguard.runtime.topology import ConsumerSpec


class Recorder(Service):
    """Stores each anomaly id in a Redis set; fails on request, to exercise settling."""

    name = "recorder"

    def __init__(self, settings: Settings, *, fail_times: dict[str, int] | None = None) -> None:
        super().__init__(settings)
        self.fail_times = dict(fail_times or {})
        self.attempts: dict[str, int] = {}
        self.rt: Runtime | None = None

    @property
    def key(self) -> str:
        return self.settings.redis_key("recorded")

    def consumers(self) -> Sequence[Consumer]:
        spec = ConsumerSpec("events", "recorder",
                            (self.settings.subjects.pattern("event", tail="anomaly"),),
                            ack_wait=5.0)
        return [Consumer(spec, self.handle, (Anomaly,))]

    async def start(self, rt: Runtime) -> None:
        self.rt = rt

    async def handle(self, anomaly: Anomaly, delivery: Delivery) -> None:
        self.attempts[anomaly.id] = self.attempts.get(anomaly.id, 0) + 1
        if anomaly.id.startswith("reject"):
            raise Reject("recorder refuses ids starting with 'reject'")
        if anomaly.id.startswith("badauth"):  # wrong credentials: no retry mends them
            raise redis.exceptions.AuthenticationError("invalid username-password pair")
        if anomaly.id.startswith("away"):  # a dependency that never comes back
            raise redis.exceptions.ConnectionError("Redis is away")
        if anomaly.id.startswith("poison") or self.fail_times.get(anomaly.id, 0) > 0:
            self.fail_times[anomaly.id] = self.fail_times.get(anomaly.id, 0) - 1
            raise RuntimeError(f"cannot record {anomaly.id}")
        assert self.rt is not None
        await self.rt.redis.sadd(self.key, anomaly.id)


@contextlib.asynccontextmanager
async def running(service: Service) -> AsyncIterator[Runtime]:
    """Run ``service`` in this loop until the block ends; yields its runtime once ready."""
    stop = asyncio.Event()
    ready: asyncio.Future[Runtime] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(run_service(service, stop, install_signals=False,
                                           started=ready.set_result))
    done, _ = await asyncio.wait({task, ready}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        task.result()
    rt = ready.result()
    try:
        yield rt
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


def recorder_settings(nats_url: str, redis_url: str, prefix: str, **extra: object) -> Settings:
    return load_settings(Settings, env={}, overrides={
        "nats_url": nats_url, "redis_url": redis_url, "prefix": prefix, "max_deliver": 3,
        **extra})
