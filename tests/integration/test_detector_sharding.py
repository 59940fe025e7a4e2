"""Several detectors split jobs through per-job leases in Redis; a job moves when its owner
stops (at once: it releases its leases) or dies (within one lease TTL)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from tests.integration.recorder import running
from tests.integration.test_detector_service import (
    FakeJob,
    anomalies,
    of,
    settings,
    until,
    worker_exit,
)
from trainguard.contract.schemas import Anomaly
from trainguard.contract.subjects import Subjects
from trainguard.runtime.bus import Bus
from trainguard.runtime.state import Keys
from trainguard.services.detector.leases import preferred
from trainguard.services.detector.service import DetectorService

ROOT = Path(__file__).resolve().parents[2]


async def lease_owners(redis_url: str, prefix: str, jobs: list[str]) -> dict[str, str | None]:
    r = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        values = await r.mget([Keys(prefix).lease("detector", j) for j in jobs])
        return dict(zip(jobs, values, strict=True))
    finally:
        await r.aclose()


def crash_ids(seen: list[Anomaly]) -> set[str]:
    """Distinct crash anomalies (at-least-once: a republished one has the same id)."""
    return {a.id for a in of(seen, "crash")}


def split_jobs(a: str, b: str, per_side: int = 2) -> list[str]:
    """Job names rendezvous hashing gives to each of two detectors, ``per_side`` each."""
    base = uuid.uuid4().hex[:6]
    sides: dict[str, list[str]] = {a: [], b: []}
    i = 0
    while min(len(v) for v in sides.values()) < per_side:
        name = f"job-{base}-{i}"
        owner = preferred(name, [a, b])
        assert owner is not None
        if len(sides[owner]) < per_side:
            sides[owner].append(name)
        i += 1
    return sides[a] + sides[b]


async def test_two_detectors_own_disjoint_jobs_and_a_stopped_owners_jobs_move(
        nats_url: str, redis_url: str, prefix: str, nc: Any) -> None:
    subjects = Subjects(prefix)
    bus = Bus(nc, subjects, source="test")
    jobs = split_jobs("det-a", "det-b")
    seen = await anomalies(nc, subjects)
    a = DetectorService(settings(nats_url, redis_url, prefix, instance_id="det-a", lease_ttl=5.0))
    b = DetectorService(settings(nats_url, redis_url, prefix, instance_id="det-b", lease_ttl=5.0))
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(running(a))
        stop_b = AsyncExitStack()
        stack.push_async_callback(stop_b.aclose)
        await stop_b.enter_async_context(running(b))
        await until(lambda: _registered(redis_url, prefix, 2), what="both detectors")
        fakes = {j: FakeJob(bus, j) for j in jobs}
        for fake in fakes.values():
            await fake.hello()
        await until(lambda: len(a.owned) + len(b.owned) == len(jobs),
                    what="every job owned")
        assert a.owned.isdisjoint(b.owned)
        assert a.owned == set(jobs[:2]) and b.owned == set(jobs[2:])
        owners = await lease_owners(redis_url, prefix, jobs)
        assert owners == {j: "det-a" if j in a.owned else "det-b" for j in jobs}
        # Per-job subscriptions: each detector sees only its own jobs' telemetry.
        for fake in fakes.values():
            await fake.steps(3)
        await until(lambda: all(
            j in (a if j in a.owned else b).detector.jobs
            and (a if j in a.owned else b).detector.jobs[j].max_step == 2 for j in jobs),
            what="telemetry reaching the owners")
        assert set(a.detector.jobs) == a.owned and set(b.detector.jobs) == b.owned
        # Each job's crash is reported once, by its owner.
        for j in jobs:
            await bus.publish_durable(subjects.exit(j, "host-0"),
                                      worker_exit(j, 1, f"{j}-x", exit_code=1))
        await until(lambda: len(crash_ids(seen)) == len(jobs),
                    what="one crash per job")
        assert sorted({c.job for c in of(seen, "crash")}) == sorted(jobs)
        # det-b stops: it hands its jobs back and det-a takes them at once.
        moved = set(b.owned)
        await stop_b.aclose()
        await until(lambda: a.owned == set(jobs), what="det-b's jobs to move")
        owners = await lease_owners(redis_url, prefix, jobs)
        assert set(owners.values()) == {"det-a"}
        # The crashes that were open moved with their jobs: nothing was raised again.
        assert len(crash_ids(seen)) == len(jobs)
        for j in moved:
            assert a.detector.jobs[j].book.keys("crash:") == ["crash:1:0"]
            await bus.publish_durable(subjects.exit(j, "host-1"),
                                      worker_exit(j, 3, f"{j}-y", exit_code=2))
        await until(lambda: len(crash_ids(seen)) == len(jobs) + len(moved),
                    what="the new owner to report new crashes")


async def _registered(redis_url: str, prefix: str, n: int) -> bool:
    r = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        return int(await r.zcard(f"{prefix}:detector:instances")) >= n
    finally:
        await r.aclose()


async def test_a_killed_owners_job_moves_within_the_lease_ttl(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any, tmp_path: Path) -> None:
    subjects = Subjects(prefix)
    bus = Bus(nc, subjects, source="test")
    seen = await anomalies(nc, subjects, job)
    env = {**os.environ, "TRAINGUARD_NATS_URL": nats_url, "TRAINGUARD_REDIS_URL": redis_url,
           "TRAINGUARD_PREFIX": prefix, "TRAINGUARD_INSTANCE_ID": "det-doomed",
           "TRAINGUARD_LEASE_TTL": "1.5", "TRAINGUARD_LEASE_INTERVAL": "0.2",
           "TRAINGUARD_TICK_INTERVAL": "0.1"}
    log = (tmp_path / "doomed.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trainguard", "service", "detector", env=env, cwd=str(ROOT),
        stdout=log, stderr=log)
    try:
        try:
            await until(lambda: _registered(redis_url, prefix, 1),
                        what="the doomed detector to register")
        except AssertionError:
            raise AssertionError((tmp_path / "doomed.log").read_text()[-3000:]) from None
        await FakeJob(bus, job).hello()
        await until(lambda: _owned_by(redis_url, prefix, job, "det-doomed"),
                    what="the doomed detector to own the job")
        survivor = DetectorService(settings(nats_url, redis_url, prefix, instance_id="det-b"))
        async with running(survivor):
            await bus.publish_durable(subjects.exit(job, "host-0"),
                                      worker_exit(job, 0, "x0", exit_code=1))
            await until(lambda: of(seen, "crash"), what="the first crash")
            assert job not in survivor.owned
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
            await until(lambda: job in survivor.owned,
                        what="the job to move after the lease expired")
            await bus.publish_durable(subjects.exit(job, "host-1"),
                                      worker_exit(job, 2, "x1", exit_code=1))
            # Killed between publishing and recording it, the doomed detector may leave
            # its crash to be sent again by the survivor: same id and rev, a duplicate.
            await until(lambda: len(crash_ids(seen)) == 2,
                        what="the survivor to report the next crash")
        assert {tuple(c.ranks) for c in of(seen, "crash")} == {(0,), (2,)}
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        log.close()


async def _owned_by(redis_url: str, prefix: str, job: str, owner: str) -> bool:
    return (await lease_owners(redis_url, prefix, [job]))[job] == owner
