"""A hang incident of a real gloo job rides out the loss of a NATS node and a Redis failover.

The control plane (detector, diagnoser, remediator) runs against a 3-node NATS cluster
(every stream and consumer with 3 replicas, clients given all three URLs) and Redis behind
three sentinels. Rank 1 of a 2-rank torchrun job hangs in its data phase; as soon as the
incident opens, the node that leads both the event and the command stream is killed and
the Redis primary with it. Then:

* no acknowledged event is lost: every event the stream held before the kill is still in
  it afterwards (read back from the new leader);
* no command runs twice: each command chain (a command and its retries) is executed by the
  agent at most once, and the job was restarted exactly once (attempts 0 and 1);
* the incident resolves and the job finishes.

The recovery times it prints (a stream accepting publishes again after its leader died,
Redis writes after the primary died, the incident from open to resolved) are the README's
reliability figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_until
from tests.e2e.conftest import job_env, launch
from tests.e2e.test_agent import exit_code
from tests.ha import NatsCluster, SentinelSet
from tests.integration.recorder import running
from tests.tap import tapped
from trainguard.contract.codec import decode_durable
from trainguard.contract.envelope import normalize_headers
from trainguard.contract.schemas import Command, Incident, RankHello, StepReport
from trainguard.contract.subjects import Subjects
from trainguard.runtime.config import load_settings
from trainguard.runtime.store import connect_redis
from trainguard.runtime.topology import stream_name
from trainguard.services.detector.service import DetectorService
from trainguard.services.detector.settings import DetectorSettings
from trainguard.services.diagnoser.service import DiagnoserService
from trainguard.services.diagnoser.settings import DiagnoserSettings
from trainguard.services.remediator.service import RemediatorService
from trainguard.services.remediator.settings import RemediatorSettings

HANG_STEP = 10

SLOW_TIMEOUT = 420
"""Nine servers, a torchrun job and its restart on two shared cores: under load the launch
alone can take a minute, so this test gets more than the usual 180 s."""


async def stored_ids(js: Any, stream: str, subjects: str) -> set[str]:
    """Every message id (``ce-id``) the stream holds under ``subjects``, read back whole."""
    sub = await js.subscribe(subjects, ordered_consumer=True, stream=stream)
    ids: set[str] = set()
    try:
        last = (await js.stream_info(stream)).state.last_seq
        while True:
            msg = await sub.next_msg(timeout=10.0)
            seq = msg.metadata.sequence.stream
            ids.add(normalize_headers(msg.headers or {}).get("ce-id") or f"#{seq}")
            if seq >= last:
                return ids
    finally:
        await sub.unsubscribe()


async def stored_incident(js: Any, stream: str, subject: str) -> Incident | None:
    """The newest incident revision the stream holds on ``subject``: a core subscriber
    misses what was published while it reconnected after the node loss."""
    try:
        msg = await js.get_last_msg(stream, subject)
    except Exception:  # the stream's leader is still being elected
        return None
    return decode_durable(msg.data, Incident)


async def until_ok(what: Any, timeout: float = 90.0) -> float:
    """Seconds until the coroutine factory ``what`` first succeeds."""
    started = time.monotonic()
    while True:
        try:
            await asyncio.wait_for(what(), 5.0)
            return time.monotonic() - started
        except Exception:
            assert time.monotonic() - started < timeout, "never recovered"
            await asyncio.sleep(0.1)


@pytest.mark.timeout(SLOW_TIMEOUT)  # before the suite's 180 s: the closest marker wins
async def test_a_hang_incident_survives_a_nats_node_loss_and_a_redis_failover(
        ready_cluster: NatsCluster, sentinel_set: SentinelSet, prefix: str, job: str,
        tmp_path: Path, procs: list[Any]) -> None:
    s = Subjects(prefix)
    conn = {"nats_url": ready_cluster.url, "redis_url": sentinel_set.url, "prefix": prefix,
            "stream_replicas": 3}
    env = job_env(ready_cluster.url, prefix, TRAINGUARD_REDIS_URL=sentinel_set.url,
                  TRAINGUARD_STREAM_REPLICAS="3")
    incidents: dict[str, Incident] = {}
    commands: dict[str, Command] = {}
    log = tmp_path / "launch.log"
    async with tapped(ready_cluster.url, prefix, job, replicas=3) as (tap, bus), \
            contextlib.AsyncExitStack() as plane:
        async def on_incident(msg: Any) -> None:
            inc = decode_durable(msg.data, Incident)
            if inc.rev >= getattr(incidents.get(inc.id), "rev", 0):
                incidents[inc.id] = inc

        async def on_command(msg: Any) -> None:
            cmd = decode_durable(msg.data, Command)
            commands[cmd.id] = cmd

        await bus.nc.subscribe(s.event(job, "incident"), cb=on_incident)
        await bus.nc.subscribe(s.pattern("cmd", job=job, tail=">"), cb=on_command)
        for service in (DetectorService(load_settings(DetectorSettings, env={}, overrides=conn)),
                        DiagnoserService(load_settings(DiagnoserSettings, env={},
                                                       overrides=conn)),
                        RemediatorService(load_settings(RemediatorSettings, env={},
                                                        overrides={**conn, "lease_ttl": 2.0}))):
            await plane.enter_async_context(running(service))
        started = time.monotonic()
        procs.append(launch(job, "node-a", env, log, trainer=[
            "--steps", "40", "--step-time", "0.05", "--hang-at", f"1:{HANG_STEP}"]))
        opened = await wait_until(lambda: [i for i in incidents.values()
                                           if i.cause == "rank_hang"],
                                  timeout=240, what="the hang incident open")
        opened_at = time.monotonic()
        js = bus.nc.jetstream(timeout=10.0)
        events, cmds = stream_name(prefix, "events"), stream_name(prefix, "cmds")
        leader = await ready_cluster.co_lead([events, cmds], bus.nc)
        before = await stored_ids(js, events, s.pattern("event", job=job, tail=">"))

        # The node leading both streams dies, and so does the Redis primary.
        leader.kill()
        old_primary = sentinel_set.primary.port
        sentinel_set.primary.kill()
        killed_at = time.monotonic()
        redis: Any = None  # connected below, once a primary answers
        probe = s.event(job, "checkpoint")  # a kind no running service consumes

        async def publish_probe() -> None:
            await js.publish(probe, b"{}", timeout=2.0)

        async def write_redis() -> None:
            nonlocal redis
            if redis is None:
                redis = await connect_redis(sentinel_set.url, timeout=4.0)
            await redis.set(f"{prefix}:probe", "1")

        try:
            nats_back, redis_back = await asyncio.gather(until_ok(publish_probe),
                                                         until_ok(write_redis))
        finally:
            if redis is not None:
                await redis.aclose()
        assert await sentinel_set.wait_failover(old_primary) == sentinel_set.replica.port

        async def resolved_incident() -> list[Incident]:
            stored = await stored_incident(js, events, s.event(job, "incident"))
            if stored is not None and stored.rev >= getattr(incidents.get(stored.id), "rev", 0):
                incidents[stored.id] = stored
            return [i for i in incidents.values()
                    if i.id == opened[0].id and i.status == "resolved"]

        try:
            resolved = await wait_until(resolved_incident, timeout=240,
                                        what="the hang incident resolved")
        except AssertionError as exc:
            inc = incidents.get(opened[0].id)
            raise AssertionError(f"{exc}: {inc!r}\n{log.read_text()[-3000:]}") from None
        resolved_at = time.monotonic()
        code = await exit_code(procs[0], timeout=150)
        assert code == 0, log.read_text()[-3000:]
        after = await stored_ids(js, events, s.pattern("event", job=job, tail=">"))
        new_leader = await ready_cluster.leader_of(events, bus.nc)

    lost = before - after
    assert not lost, f"{len(lost)} acknowledged events lost"
    assert new_leader is not leader
    # Each command chain (a command and its retries) ran at most once on the agent.
    def root(cid: str) -> str:
        cmd = commands.get(cid)
        return root(cmd.retry_of) if cmd is not None and cmd.retry_of else cid

    ran: dict[str, int] = {}
    for ack in tap.acks:
        if ack.outcome == "done" and not ack.detail.startswith("already done"):
            ran[root(ack.command_id)] = ran.get(root(ack.command_id), 0) + 1
    twice = {cid: n for cid, n in ran.items() if n > 1}
    assert not twice, f"commands run more than once: {twice}: " + repr([
        (a.command_id, a.responder, a.kind, a.time, a.detail) for a in tap.acks
        if root(a.command_id) in twice])
    assert {h.attempt.restart_count for h in tap.of(RankHello)} == {0, 1}, \
        ([(h.rank, h.attempt, h.pid) for h in tap.of(RankHello)], log.read_text()[-4000:])
    assert max(r.step for r in tap.of(StepReport) if r.attempt == 1) == 39
    inc = resolved[0]
    print(f"\nHA figures: events lost {len(lost)} of {len(before)}, commands run twice "
          f"{len(twice)} of {len(ran)}, stream publishes back {nats_back:.1f}s and Redis "
          f"writes back {redis_back:.1f}s after the kill, incident resolved "
          f"{resolved_at - killed_at:.1f}s after the kill (opened {opened_at - started:.1f}s "
          f"after the launch; actions {[(a.action, a.status) for a in inc.actions]})")
