"""Many jobs on one detector: one job's burst of durable messages holds up no other job."""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack
from typing import Any

from tests.conftest import wait_until
from tests.integration.recorder import running
from tests.integration.test_detector_service import (
    FakeJob,
    anomalies,
    of,
    settings,
    until,
    worker_exit,
)
from tests.integration.test_detector_sharding import _registered, split_jobs
from trainguard.contract.subjects import Subjects
from trainguard.core.connection import flush
from trainguard.runtime.bus import Bus
from trainguard.services.detector.service import DetectorService

STORM = 300


async def test_a_crash_storm_in_one_job_does_not_hold_up_another_jobs_crash(
        nats_url: str, redis_url: str, prefix: str, nc: Any) -> None:
    """Each worker exit's handler waits for Redis and the bus; the exits of one job are
    handled in order, but another job's crash is not queued behind them."""
    subjects = Subjects(prefix)
    bus = Bus(nc, subjects, source="test")
    storm, probe = "job-storm", "job-probe"
    seen = await anomalies(nc, subjects)

    svc = DetectorService(settings(nats_url, redis_url, prefix))
    async with running(svc):
        await FakeJob(bus, storm, ranks=STORM).hello()
        await FakeJob(bus, probe).hello()
        await until(lambda: {storm, probe} <= svc.owned, what="both jobs owned")
        times: dict[str, list[float]] = {storm: [], probe: []}

        async def on_anomaly(msg: Any) -> None:
            for job in times:
                if msg.subject == subjects.event(job, "anomaly"):
                    times[job].append(time.monotonic())

        await nc.subscribe(subjects.pattern("event", tail="anomaly"), cb=on_anomaly)
        await flush(nc)
        await asyncio.gather(*(bus.publish_durable(subjects.exit(storm, f"host-{r // 2}"),
                                                   worker_exit(storm, r, f"s{r}", exit_code=1))
                               for r in range(STORM)))
        await bus.publish_durable(subjects.exit(probe, "host-0"),
                                  worker_exit(probe, 1, "p1", exit_code=1))
        await until(lambda: len(times[storm]) >= STORM and times[probe],
                    what="every crash reported")
        # The probe's exit came last; it was not handled last.
        assert times[probe][0] < times[storm][-1]
        assert len({a.ranks[0] for a in of(seen, "crash") if a.job == storm}) == STORM
        assert [a.ranks for a in of(seen, "crash") if a.job == probe] == [[1]]


async def test_a_busy_detector_hands_another_detectors_job_back_at_once(
        nats_url: str, redis_url: str, prefix: str, nc: Any) -> None:
    """Both detectors fetch every job's exits. The one that does not own a job hands its
    messages back without waiting behind its own work (here its ownership lock, held as a
    burst of messages of jobs nobody owns yet would hold it) and without Redis round trips,
    and soon: the owner's crashes come within a second or two, not at ack_wait."""
    subjects = Subjects(prefix)
    bus = Bus(nc, subjects, source="test")
    job = split_jobs("det-a", "det-b", per_side=1)[0]  # det-a's by rendezvous hashing
    seen = await anomalies(nc, subjects, job)
    a = DetectorService(settings(nats_url, redis_url, prefix, instance_id="det-a",
                                 lease_ttl=5.0, retry_delay=5.0))
    b = DetectorService(settings(nats_url, redis_url, prefix, instance_id="det-b",
                                 lease_ttl=5.0, retry_delay=5.0))
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(running(a))
        await stack.enter_async_context(running(b))
        await until(lambda: _registered(redis_url, prefix, 2), what="both detectors")
        await FakeJob(bus, job, ranks=16).hello()
        await until(lambda: job in a.owned, what="det-a to own the job")
        await asyncio.sleep(1.0)  # det-b's lease rounds have seen det-a's lease
        async with b._own_lock:
            for r in range(16):
                await bus.publish_durable(subjects.exit(job, f"host-{r // 2}"),
                                          worker_exit(job, r, f"x{r}", exit_code=1))
            await wait_until(lambda: len({x.ranks[0] for x in of(seen, "crash")}) == 16,
                             timeout=4.0, what="every crash, whichever detector fetched it")
        assert job not in b.owned
