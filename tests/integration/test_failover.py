"""A SIGKILLed detector or remediator leader is replaced long before its lease expires
(issue 34): its peer sees it gone from the bus (``trainguard.runtime.presence``), takes its
lease over and acts on the fault that follows the kill.

The leases here last a minute and the waits are far shorter: only the presence takeover can
pass. ``bench/bench_failover.py`` measures the same at 16,384 ranks.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from tests.conftest import wait_until
from tests.integration.recorder import running
from tests.integration.test_detector_service import FakeJob, anomalies, of, settings, worker_exit
from tests.integration.test_detector_sharding import lease_owners
from tests.integration.test_remediator_service import diagnosis, settings_for, stage
from trainguard.contract.subjects import Subjects, stream_name
from trainguard.runtime.bus import Bus
from trainguard.runtime.topology import provision, streams
from trainguard.services.detector.service import DetectorService
from trainguard.services.remediator.service import RemediatorService

ROOT = Path(__file__).resolve().parents[2]
LEASE_TTL = 60.0
TAKEOVER_WAIT = 20.0
"""Well under ``LEASE_TTL``: the lease's expiry cannot be what moves a detector's job."""
LEADER_TTL = 40.0
"""The leader lock's: renewed, and asked after by the standby, every quarter of it. The
standby's second 'no responders' comes at most half of it after the kill; the lock of a
leader renewed last a quarter before its kill expires three quarters after it at the
soonest, hence the wait below."""
LEADER_WAIT = 0.7 * LEADER_TTL


@asynccontextmanager
async def service_process(service: str, env: dict[str, str], log: Path,
                          ttl: float) -> AsyncIterator[asyncio.subprocess.Process]:
    """``trainguard service <service>`` as its own process (killed at the end if alive)."""
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "trainguard", "service", service, cwd=str(ROOT),
            env={**os.environ, "TRAINGUARD_LEASE_TTL": str(ttl), **env},
            stdout=out, stderr=out)
        try:
            yield proc
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


@asynccontextmanager
async def survivor_of(doomed: asyncio.subprocess.Process, nats_url: str, redis_url: str,
                      prefix: str, job: str) -> AsyncIterator[DetectorService]:
    """A second detector, running once it knows ``job``'s owner, "det-doomed", which is
    then SIGKILLed."""
    survivor = DetectorService(settings(nats_url, redis_url, prefix, instance_id="det-b",
                                        lease_ttl=LEASE_TTL))
    async with running(survivor):
        await wait_until(lambda: survivor.elsewhere.get(job) == "det-doomed",
                         what="the survivor to know the job's owner")
        doomed.kill()
        await doomed.wait()
        yield survivor


async def test_a_killed_detectors_job_moves_at_once_and_its_next_crash_is_seen(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any, tmp_path: Path) -> None:
    subjects = Subjects(prefix)
    bus = Bus(nc, subjects, source="test")
    await provision(nc.jetstream(), streams(prefix))
    seen = await anomalies(nc, subjects, job)
    env = {"TRAINGUARD_NATS_URL": nats_url, "TRAINGUARD_REDIS_URL": redis_url,
           "TRAINGUARD_PREFIX": prefix, "TRAINGUARD_INSTANCE_ID": "det-doomed",
           "TRAINGUARD_LEASE_INTERVAL": "0.2"}
    log = tmp_path / "doomed.log"
    async with service_process("detector", env, log, LEASE_TTL) as doomed:
        await FakeJob(bus, job).hello()

        async def owner() -> str | None:
            return (await lease_owners(redis_url, prefix, [job]))[job]

        try:
            await wait_until(lambda: _is(owner(), "det-doomed"), timeout=60,
                             what="the doomed detector to own the job")
        except AssertionError:
            raise AssertionError(log.read_text()[-3000:]) from None
        async with survivor_of(doomed, nats_url, redis_url, prefix, job) as survivor:
            await bus.publish_durable(subjects.exit(job, "host-1"),
                                      worker_exit(job, 2, "x1", exit_code=1))
            await wait_until(lambda: [a for a in of(seen, "crash") if a.ranks == [2]],
                             timeout=TAKEOVER_WAIT, what="the survivor to see the crash")
            assert job in survivor.owned
            assert await owner() == "det-b"


async def test_an_exit_the_killed_detector_held_is_read_back_from_the_stream(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any, tmp_path: Path) -> None:
    """The dead owner's fetch held the exit unacknowledged: the consumer would send it
    again only after its ack_wait (30 s). Here the test holds it, in the doomed detector's
    stead (stopped, then killed): the survivor reads it back from the stream."""
    subjects = Subjects(prefix)
    bus = Bus(nc, subjects, source="test")
    js = nc.jetstream()
    await provision(js, streams(prefix))
    seen = await anomalies(nc, subjects, job)
    env = {"TRAINGUARD_NATS_URL": nats_url, "TRAINGUARD_REDIS_URL": redis_url,
           "TRAINGUARD_PREFIX": prefix, "TRAINGUARD_INSTANCE_ID": "det-doomed",
           "TRAINGUARD_LEASE_INTERVAL": "0.2"}
    async with service_process("detector", env, tmp_path / "doomed.log", LEASE_TTL) as doomed:
        await FakeJob(bus, job).hello()
        await wait_until(lambda: _is(lease_owners(redis_url, prefix, [job]),
                                     {job: "det-doomed"}), timeout=60,
                         what="the doomed detector to own the job")
        doomed.send_signal(signal.SIGSTOP)  # connected, fetching nothing
        held = await js.pull_subscribe_bind("detector-exit", stream_name(prefix, "reports"))
        await bus.publish_durable(subjects.exit(job, "host-1"),
                                  worker_exit(job, 2, "x1", exit_code=1))

        async def in_hand() -> bool:
            """The exit is delivered and unacknowledged: to this fetch, or to the pull
            request the doomed detector had open when it stopped."""
            with contextlib.suppress(TimeoutError):
                await held.fetch(1, timeout=0.2)
            info = await js.consumer_info(stream_name(prefix, "reports"), "detector-exit")
            return info.num_pending == 0 and info.num_ack_pending >= 1

        await wait_until(in_hand, what="the exit held by the doomed side")
        async with survivor_of(doomed, nats_url, redis_url, prefix, job):
            await wait_until(lambda: [a for a in of(seen, "crash") if a.ranks == [2]],
                             timeout=TAKEOVER_WAIT, what="the survivor to see the crash")


async def test_a_killed_leaders_standby_leads_at_once_and_decides(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any, tmp_path: Path) -> None:
    agents, seen = await stage(nc, redis_url, prefix, job)
    env = {"TRAINGUARD_NATS_URL": nats_url, "TRAINGUARD_REDIS_URL": redis_url,
           "TRAINGUARD_PREFIX": prefix}
    log = tmp_path / "leader.log"
    async with service_process("remediator", env, log, LEADER_TTL) as doomed:
        try:
            await wait_until(lambda: "leading with epoch" in log.read_text(), timeout=60,
                             what="the first remediator to lead")
        except AssertionError:
            raise AssertionError(log.read_text()[-3000:]) from None
        standby = RemediatorService(settings_for(nats_url, redis_url, prefix,
                                                 lease_ttl=LEADER_TTL))
        async with running(standby):
            assert standby.leader is not None and not standby.leader.leading
            doomed.kill()
            await doomed.wait()
            await Bus(nc, Subjects(prefix), source="test").publish_durable(
                Subjects(prefix).event(job, "diagnosis"), diagnosis(job, "d1"))
            await wait_until(lambda: standby.leader is not None and standby.leader.leading,
                             timeout=LEADER_WAIT, what="the standby to lead")
            await wait_until(lambda: [i for i in seen if i.actions], timeout=30,
                             what="the new leader to plan the incident")
            await wait_until(lambda: agents.commands, timeout=30,
                             what="the new leader's first command")


async def _is(value: Any, want: Any) -> bool:
    return await value == want
