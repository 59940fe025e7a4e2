"""The detector through the control plane's own faults, on real servers.

A frozen NATS server is one bus fault, not every rank failing; a restarted detector takes
its job back at once; a Redis outage does not hold hang detection back; an agent that says
its workers are restarting explains their silence.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import nats
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from tests.integration.recorder import running
from tests.integration.test_detector_service import (
    FakeJob,
    _progress_after,
    anomalies,
    detecting,
    every_rank_ok_after_the_grace,
    of,
    settings,
    until,
    worker_exit,
)
from tests.integration.test_detector_sharding import _owned_by
from trainguard.contract.schemas import Anomaly, NodeHeartbeat
from trainguard.contract.subjects import Subjects
from trainguard.runtime.bus import Bus
from trainguard.runtime.embedded import NatsServer, RedisServer, free_port
from trainguard.runtime.state import Keys
from trainguard.services.detector.service import DetectorService

ROOT = Path(__file__).resolve().parents[2]


def silent_kinds(seen: list[Anomaly]) -> list[tuple[str, list[int]]]:
    return [(a.kind, a.ranks) for a in seen
            if a.kind in ("unresponsive", "hang", "crash") and a.status == "open"]


async def test_a_frozen_nats_server_is_one_bus_fault_not_every_rank_failing(
        private_nats: NatsServer, redis_url: str, prefix: str, job: str) -> None:
    svc = DetectorService(settings(private_nats.url, redis_url, prefix))
    pub = await nats.connect(private_nats.url)
    try:
        async with detecting(svc, pub, job) as (ranks, seen), \
                ranks.beating_in_background(stepping=True):
            judged = time.time() + 0.5
            await until(lambda: _progress_after(redis_url, prefix, job, judged),
                        what="the detector to judge the running job")
            assert private_nats.pid is not None
            os.kill(private_nats.pid, signal.SIGSTOP)
            try:
                await until(lambda: svc.bus_view.stale_since is not None,
                            what="the detector to see its bus stall")
                await asyncio.sleep(3 * svc.cfg.hb_timeout)  # the outage itself
            finally:
                os.kill(private_nats.pid, signal.SIGCONT)
            await until(lambda: svc.bus_view.stale_since is None,
                        what="the bus to answer again")
            await every_rank_ok_after_the_grace(redis_url, prefix, job, svc.cfg.hb_timeout)
            assert silent_kinds(seen) == [], "the stall was read as failing ranks"
            # Judging goes on afterwards: a rank that really falls silent is named alone.
            ranks.beating.discard(3)
            await until(lambda: of(seen, "unresponsive"), what="the silent rank's alert")
        assert silent_kinds(seen) == [("unresponsive", [3])]
        assert svc.bus_view.stalls >= 1
    finally:
        await pub.close()


async def _readyz(port: int) -> bool:
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    try:
        writer.write(b"GET /readyz HTTP/1.0\r\n\r\n")
        await writer.drain()
        return (await reader.readline()).split()[1:2] == [b"200"]
    except (OSError, IndexError):
        return False
    finally:
        writer.close()


async def test_a_restarted_detector_takes_its_job_back_at_once_and_a_stopped_one_hands_over(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any, tmp_path: Path) -> None:
    subjects = Subjects(prefix)
    bus = Bus(nc, subjects, source="test")
    seen = await anomalies(nc, subjects, job)
    port = free_port()
    ttl = 30.0  # long: waiting out a lease would be unmistakable
    env = {**os.environ, "TRAINGUARD_NATS_URL": nats_url, "TRAINGUARD_REDIS_URL": redis_url,
           "TRAINGUARD_PREFIX": prefix, "TRAINGUARD_HEALTH_PORT": str(port),
           "TRAINGUARD_LEASE_TTL": str(ttl), "TRAINGUARD_LEASE_INTERVAL": "0.5",
           "TRAINGUARD_TICK_INTERVAL": "0.1"}
    env.pop("TRAINGUARD_INSTANCE_ID", None)
    logs = [tmp_path / "first.log", tmp_path / "second.log"]

    async def detector(log: Path) -> asyncio.subprocess.Process:
        with log.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "trainguard", "service", "detector", env=env,
                cwd=str(ROOT), stdout=out, stderr=out)
        try:
            await until(lambda: _readyz(port), what=f"the detector of {log.name} to be ready")
        except AssertionError:
            raise AssertionError(log.read_text()[-3000:]) from None
        return proc

    procs: list[asyncio.subprocess.Process] = []
    try:
        procs.append(await detector(logs[0]))
        await FakeJob(bus, job).hello()
        name = f"{socket.gethostname()}:{port}"  # the default name: stable across restarts
        await until(lambda: _owned_by(redis_url, prefix, job, name), what="the first to own it")
        procs[0].send_signal(signal.SIGKILL)
        await procs[0].wait()
        procs.append(await detector(logs[1]))
        ready = time.monotonic()
        await bus.publish_durable(subjects.exit(job, "host-0"),
                                  worker_exit(job, 1, "x1", exit_code=1))
        await until(lambda: of(seen, "crash"), what="the restarted detector to judge the job")
        took = time.monotonic() - ready
        assert took < 3.0, f"the restarted detector waited {took:.1f}s for its own lease"
        assert await _owned_by(redis_url, prefix, job, name)
        # A clean stop hands the job over at once to whoever is left.
        other = DetectorService(settings(nats_url, redis_url, prefix, instance_id="det-other",
                                         lease_ttl=ttl))
        async with running(other):
            procs[1].send_signal(signal.SIGTERM)
            await procs[1].wait()
            stopped = time.monotonic()
            await until(lambda: job in other.owned, what="the other detector to take the job")
            took = time.monotonic() - stopped
            assert took < 3.0, f"the job waited {took:.1f}s after its owner stopped"
        assert procs[1].returncode == 0, logs[1].read_text()[-3000:]
        assert "owns job" in logs[1].read_text()
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def _hang_after(ranks: FakeJob, seen: list[Anomaly], culprit: int) -> float:
    """Stall the job on ``culprit`` and return how long the hang took to arrive."""
    before = len(of(seen, "hang"))
    for r in ranks.ranks:
        ranks.set_phase(r, "data" if r == culprit else "comm")
    stalled = time.monotonic()
    await until(lambda: len(of(seen, "hang")) > before, what=f"a hang of rank {culprit}")
    took = time.monotonic() - stalled
    assert of(seen, "hang")[-1].ranks == [culprit]
    for r in ranks.ranks:
        ranks.set_phase(r, "compute")
    return took


async def test_a_hang_is_caught_while_redis_is_down_as_fast_as_with_it(
        nats_url: str, private_redis: RedisServer, prefix: str, job: str, nc: Any) -> None:
    # hang_k small: the first hang's long step must not lengthen the second's limit.
    svc = DetectorService(settings(nats_url, private_redis.url, prefix, lease_ttl=60.0,
                                   lease_interval=0.5, hang_k=0.5))
    async with detecting(svc, nc, job) as (ranks, seen):
        await ranks.steps(20)
        async with ranks.beating_in_background():
            with_redis = await _hang_after(ranks, seen, 2)
            await ranks.steps(3)
            await until(lambda: of(seen, "hang", "resolved"), what="the first hang to resolve")
            # Stopped while the job steps on (a gap in its steps would lengthen the limit).
            await asyncio.gather(asyncio.to_thread(private_redis.stop), ranks.steps(20))
            without_redis = await _hang_after(ranks, seen, 1)
            assert not private_redis.running(), "caught only once Redis was back"
            assert job in svc.owned
            assert without_redis < with_redis + 1.5, (with_redis, without_redis)
            hang = of(seen, "hang")[-1]
            # The dedupe record follows once Redis is back.
            private_redis.start()
            await until(lambda: _stored_rev(private_redis.url, prefix, job, hang.rev),
                        what="the hang's record to reach Redis")


async def _stored_rev(redis_url: str, prefix: str, job: str, rev: int) -> bool:
    r = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        return await r.hget(Keys(prefix).dedupe("detector", job), "pub:hang") == str(rev)
    except (OSError, RedisConnectionError):
        return False
    finally:
        await r.aclose()


async def test_an_agent_restarting_its_workers_explains_their_silence_for_a_bounded_time(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any) -> None:
    svc = DetectorService(settings(nats_url, redis_url, prefix, restart_timeout=5.0))
    subjects = Subjects(prefix)
    bus = Bus(nc, subjects, source="test")
    async with detecting(svc, nc, job) as (ranks, seen):
        await ranks.steps(10)
        since = time.time()

        async def agent_beats() -> None:
            seq = 0
            while True:
                seq += 1
                await bus.publish_telemetry(subjects.node(job, "host-0"), NodeHeartbeat(
                    job=job, time=time.time(), seq=seq, host="host-0",
                    ranks={0: "S", 1: "S"}, restarting=True, restarting_since=since))
                await asyncio.sleep(0.2)

        agent = asyncio.create_task(agent_beats())
        try:
            async with ranks.beating_in_background(stepping=True):
                ranks.beating -= {0, 1}  # host-0's workers are down for the restart
                await until(lambda: _progress_after(redis_url, prefix, job,
                                                    since + svc.cfg.hb_timeout + 1.5),
                            what="the detector to judge the silence")
                assert silent_kinds(seen) == [], "a restart's silence was read as failure"
                # A restart that lasts past restart_timeout is stuck: judged again.
                await until(lambda: of(seen, "unresponsive"), what="the stuck restart's alert")
        finally:
            agent.cancel()
    [alert] = of(seen, "unresponsive")
    assert alert.ranks == [0, 1] and alert.hosts == ["host-0"]
    assert alert.detected_at >= since + svc.cfg.restart_timeout
    assert silent_kinds(seen) == [("unresponsive", [0, 1])]


async def test_two_live_detectors_never_share_the_default_name(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any) -> None:
    first = DetectorService(settings(nats_url, redis_url, prefix))
    second = DetectorService(settings(nats_url, redis_url, prefix))
    async with running(first), running(second):
        assert first.instance == socket.gethostname()  # health port 0: the host alone
        assert second.instance.startswith(first.instance + "-"), second.instance
        ranks = FakeJob(Bus(nc, Subjects(prefix), source="test"), job)
        await ranks.hello()
        await until(lambda: job in first.owned or job in second.owned,
                    what="one detector to take the job")
        later = time.time() + 1.0  # several lease rounds later
        await ranks.beat()
        await until(lambda: _progress_after(redis_url, prefix, job, later),
                    what="lease rounds to pass")
        assert not (job in first.owned and job in second.owned)
