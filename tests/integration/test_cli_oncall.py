"""``trainguard status / incidents / events`` against real Redis and JetStream state."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from typing import Any

import redis.asyncio as aioredis

from trainguard.contract.codec import encode_durable
from trainguard.contract.schemas import Anomaly, Incident, IncidentStep
from trainguard.contract.subjects import Subjects
from trainguard.runtime.bus import Bus
from trainguard.runtime.state import (
    BlocklistEntry,
    Keys,
    Progress,
    RankProgress,
    encode_blocklist_entry,
    encode_progress,
)
from trainguard.runtime.topology import provision, streams


async def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "trainguard", *args],
                                   capture_output=True, text=True, timeout=60)


async def test_oncall_views(nats_url: str, redis_url: str, prefix: str, job: str,
                            nc: Any) -> None:
    keys, s, now = Keys(prefix), Subjects(prefix), time.time()
    r = aioredis.Redis.from_url(redis_url)
    await r.set(keys.progress(job), encode_progress(Progress(
        job=job, time=now, world_size=2, incarnation=1, last_step=42, median_step_time=0.1,
        ranks={0: RankProgress(rank=0, step=42), 1: RankProgress(rank=1, step=40,
                                                                  state="hung")})))
    inc = Incident(id="inc-1", job=job, cause="rank_hang", status="resolved", hosts=["node-b"],
                   onset_at=now - 30, detected_at=now - 24, mitigated_at=now - 20,
                   resolved_at=now - 5, steps_lost=7,
                   actions=[IncidentStep(action="restart", status="done")])
    await r.hset(keys.incidents(job), inc.id, encode_durable(inc))
    await r.hset(keys.blocklist(), "node-z", '{"reason": "ecc"}')  # written by hand
    await r.hset(keys.blocklist(), "node-y", encode_blocklist_entry(BlocklistEntry(
        reason="xid 79", cause="gpu_lost", job=job, incident="inc-1", time=now - 60)))
    await r.hset(keys.blocklist(), "node-x", "maintenance")
    await r.aclose()
    await provision(nc.jetstream(), streams(prefix))
    await Bus(nc, s, source="test").publish_durable(s.event(job, "anomaly"), Anomaly(
        id="a1", job=job, kind="hang", ranks=[1], onset_at=now, detected_at=now))
    conn = ["--nats", nats_url, "--redis", redis_url, "--prefix", prefix]

    out = await cli("status", "--job", job, "--json", *conn)
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert status["jobs"][job]["progress"]["last_step"] == 42
    assert status["blocklist"]["node-z"]["reason"] == "ecc"
    assert status["blocklist"]["node-y"]["incident"] == "inc-1"
    assert status["blocklist"]["node-x"]["reason"] == "maintenance"  # not an entry: its text
    text = await cli("status", "--job", job, *conn)
    assert "1 hung" in text.stdout and "blocklisted: node-z ecc" in text.stdout
    assert f"blocklisted: node-y xid 79 (job {job}, gpu_lost," in text.stdout

    out = await cli("incidents", "--job", job, "--json", *conn)
    (row,) = [json.loads(line) for line in out.stdout.splitlines()]
    assert row["steps_lost"] == 7 and row["cause"] == "rank_hang"
    table = await cli("incidents", "--job", job, *conn)
    assert "rank_hang" in table.stdout and "6.0s" in table.stdout  # time to detect

    out = await cli("events", "--job", job, "--json", *conn)
    assert out.returncode == 0, out.stderr
    (event,) = [json.loads(line) for line in out.stdout.splitlines()]
    assert event["type"] == "io.trainguard.anomaly.v1" and event["event"]["id"] == "a1"
