"""The CLI tells the whole story (issue 18): ``trainguard events`` prints every event of
the filter and follows; enum options are validated; ``trainguard incidents show ID``.

Real nats-server and redis-server; the CLI runs as a separate process, as on-call runs it.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import redis.asyncio as aioredis

from tests.integration.test_cli_oncall import cli
from trainguard.contract.codec import encode_durable
from trainguard.contract.evidence import HangEvidence
from trainguard.contract.schemas import (
    Action,
    Anomaly,
    CheckpointCommitted,
    Diagnosis,
    EvidenceItem,
    Incident,
    IncidentStep,
)
from trainguard.contract.subjects import Subjects
from trainguard.runtime.bus import Bus
from trainguard.runtime.state import Keys
from trainguard.runtime.topology import provision, streams


def history(job: str, now: float) -> list[tuple[str, Any]]:
    anomaly = Anomaly(id="a1", job=job, kind="hang", ranks=[2], hosts=["node-b"], step=120,
                      onset_at=now - 9, detected_at=now - 4,
                      evidence=HangEvidence(culprits=[2], culprit_basis="phase"))
    diagnosis = Diagnosis(id="d1", job=job, anomaly_ids=["a1"], cause="rank_hang",
                          confidence=0.9, ranks=[2], hosts=["node-b"], step=120,
                          summary="rank 2 stuck in data",
                          evidence=[EvidenceItem(fact="rank 2 in phase data for 9s",
                                                 source="detector", value={"phase": "data"})])
    return [
        ("anomaly", anomaly),
        ("diagnosis", diagnosis),
        ("action", Action(id="x1", job=job, action="dump", incident_id="inc-0192abc")),
        ("incident", Incident(id="inc-0192abc", job=job, cause="rank_hang", status="open")),
        ("checkpoint", CheckpointCommitted(id="c1", job=job, step=100, path="/ckpt/100")),
        ("anomaly", Anomaly(id="a1", job=job, kind="hang", ranks=[2], step=120, onset_at=now - 9,
                            detected_at=now - 4, status="resolved", rev=2)),
    ]


async def publish_history(nc: Any, prefix: str, job: str, now: float) -> int:
    s = Subjects(prefix)
    await provision(nc.jetstream(), streams(prefix))
    bus = Bus(nc, s, source="test")
    events = history(job, now)
    for kind, event in events:
        await bus.publish_durable(s.event(job, kind), event)
    return len(events)


async def test_events_prints_every_event_of_the_filter(nats_url: str, prefix: str, job: str,
                                                       nc: Any) -> None:
    """Regression: ``events --job J`` printed 1 of 6 events (end of history was taken as
    ``num_pending == 0`` of a consumer whose messages sat in the client's buffer)."""
    n = await publish_history(nc, prefix, job, time.time())
    await publish_history(nc, prefix, job + "-other", time.time())  # another job's
    conn = ["--nats", nats_url, "--prefix", prefix]
    for _ in range(3):
        out = await cli("events", "--job", job, "--json", *conn)
        assert out.returncode == 0, out.stderr
        rows = [json.loads(line) for line in out.stdout.splitlines()]
        assert len(rows) == n
        assert {r["event"]["job"] for r in rows} == {job}
    out = await cli("events", "--job", job, "--kind", "anomaly", "--json", *conn)
    assert [json.loads(line)["event"]["rev"] for line in out.stdout.splitlines()] == [1, 2]
    out = await cli("events", "--json", *conn)  # every job
    assert len(out.stdout.splitlines()) == 2 * n
    out = await cli("events", "--job", job + "-none", *conn)
    assert (out.returncode, out.stdout) == (0, "")
    text = await cli("events", "--job", job, *conn)
    assert "rank_hang" in text.stdout and "rank 2 stuck in data" in text.stdout


async def test_events_kind_is_validated(nats_url: str, prefix: str) -> None:
    """Regression: ``--kind bogus`` exited 0 with no output."""
    out = await cli("events", "--kind", "bogus", "--nats", nats_url, "--prefix", prefix)
    assert out.returncode == 2
    assert "argument --kind: invalid choice: 'bogus'" in out.stderr
    assert "anomaly" in out.stderr and "incident" in out.stderr  # the choices are listed


async def test_events_follow_prints_history_then_new_events(nats_url: str, prefix: str,
                                                           job: str, nc: Any) -> None:
    n = await publish_history(nc, prefix, job, time.time())
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trainguard", "events", "--job", job, "--follow", "--json",
        "--nats", nats_url, "--prefix", prefix, stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    try:
        lines = [await asyncio.wait_for(proc.stdout.readline(), 60) for _ in range(n)]
        assert [json.loads(line)["event"]["id"] for line in lines][:2] == ["a1", "d1"]
        s = Subjects(prefix)
        await Bus(nc, s, source="test").publish_durable(s.event(job, "incident"), Incident(
            id="inc-0192abc", job=job, cause="rank_hang", status="resolved", rev=2))
        late = json.loads(await asyncio.wait_for(proc.stdout.readline(), 60))
        assert (late["event"]["status"], late["event"]["rev"]) == ("resolved", 2)
        assert proc.returncode is None  # still following
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 30)


async def test_incidents_show_prints_timeline_evidence_and_actions(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any) -> None:
    now = time.time()
    await publish_history(nc, prefix, job, now)
    inc = Incident(id="inc-0192abc", job=job, cause="rank_hang", status="resolved", rev=4,
                   ranks=[2], hosts=["node-b"], diagnosis_ids=["d1"], anomaly_ids=["a1"],
                   onset_at=now - 9, detected_at=now - 4, diagnosed_at=now - 3.5,
                   first_action_at=now - 3, mitigated_at=now - 2, resolved_at=now,
                   failure_step=120, resume_step=100, steps_lost=20,
                   summary="rank 2 stuck in data",
                   actions=[IncidentStep(action="dump", status="done", command_ids=["cmd-1"],
                                         at=now - 3),
                            IncidentStep(action="restart", status="done",
                                         command_ids=["cmd-2"], at=now - 2.5,
                                         detail="attempt 1 -> 2")])
    other = Incident(id="inc-0199zzz", job=job, cause="straggler", status="open")
    r = aioredis.Redis.from_url(redis_url)
    for i in (inc, other):
        await r.hset(Keys(prefix).incidents(job), i.id, encode_durable(i))
    await r.aclose()
    conn = ["--nats", nats_url, "--redis", redis_url, "--prefix", prefix]

    out = await cli("incidents", "show", "inc-0192", *conn)  # a unique prefix
    assert out.returncode == 0, out.stderr
    text = out.stdout
    order = ["onset", "detected", "diagnosed", "first action", "mitigated", "resolved"]
    at = [text.index(f"  {name} ") for name in order]
    assert at == sorted(at), text
    assert "+9.0s" in text and "steps lost 20" in text
    assert "diagnosis d1 rank_hang (confidence 0.90" in text
    assert "- rank 2 in phase data for 9s [detector]" in text
    assert "anomaly a1 hang ranks 2 step 120 (resolved)" in text  # its newest revision
    assert "1. dump" in text and "2. restart" in text and "commands cmd-2" in text
    assert "attempt 1 -> 2" in text

    out = await cli("incidents", "show", "inc-0192abc", "--json", *conn)
    body = json.loads(out.stdout)
    assert body["incident"]["rev"] == 4 and [d["id"] for d in body["diagnoses"]] == ["d1"]
    assert [(a["id"], a["rev"]) for a in body["anomalies"]] == [("a1", 2)]

    out = await cli("incidents", "show", "inc-01", *conn)
    assert out.returncode == 2 and "matches 2 incidents" in out.stderr
    out = await cli("incidents", "show", "nope", *conn)
    assert out.returncode == 2 and "no incident 'nope'" in out.stderr
    listing = await cli("incidents", "--job", job, *conn)  # without `show`: the table
    assert listing.returncode == 0 and "inc-0192" in listing.stdout


async def test_events_reads_a_long_history_whole(nats_url: str, prefix: str, job: str,
                                                 nc: Any) -> None:
    """More events than one push of the ordered consumer: the end is the server's count."""
    s = Subjects(prefix)
    await provision(nc.jetstream(), streams(prefix))
    bus = Bus(nc, s, source="test")
    for i in range(200):
        await bus.publish_durable(s.event(job, "action"), Action(id=f"x{i}", job=job,
                                                                  action="alert"))
    out = await cli("events", "--job", job, "--json", "--nats", nats_url, "--prefix", prefix)
    assert [json.loads(line)["event"]["id"] for line in out.stdout.splitlines()] == \
        [f"x{i}" for i in range(200)]
