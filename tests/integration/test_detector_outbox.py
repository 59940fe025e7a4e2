"""The detector's outbox against a real Redis: a job taken back while the anomaly changes of
a Redis outage are still pending starts from them (an anomaly opened during the outage is
open, one resolved during it is not), so nothing opened stays open for good."""

from __future__ import annotations

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter

from trainguard.contract.schemas import Anomaly
from trainguard.runtime.state import Keys
from trainguard.services.detector.book import Transition, dump_anomaly
from trainguard.services.detector.leases import ROLE
from trainguard.services.detector.outbox import AnomalyOutbox
from trainguard.services.detector.writebehind import Outage


def hang(job: str, ident: str, status: str = "open") -> Anomaly:
    return Anomaly(id=ident, job=job, kind="hang", ranks=[1], onset_at=1.0, detected_at=2.0,
                   status=status)  # type: ignore[arg-type]


async def test_a_job_taken_back_starts_from_the_changes_still_pending(
        redis_url: str, prefix: str, job: str) -> None:
    redis = aioredis.from_url(redis_url, decode_responses=True)
    keys = Keys(prefix)
    sent: list[Transition] = []

    async def publish(t: Transition) -> None:
        sent.append(t)

    counter = Counter("published", "", ["kind", "status"], registry=CollectorRegistry())
    outbox = AnomalyOutbox(redis, keys, publish, 0.1, Outage("Redis"), counter)
    try:
        stored = hang(job, "before")  # stored before the outage, resolved during it
        await redis.hset(keys.dedupe(ROLE, job), "hang:before", dump_anomaly(stored))
        # The outage: changes pending, not written; Redis not known to be back yet.
        outbox.writes.outage.failed("storing anomaly state", ConnectionError("down"))
        outbox.writes.pending.set(keys.dedupe(ROLE, job), "hang:during",
                                  dump_anomaly(hang(job, "during")))
        outbox.writes.pending.delete(keys.dedupe(ROLE, job), "hang:before")
        open_, _ = await outbox.load(job, settle=1.0)
        assert sorted(open_) == ["hang:during"]
        assert [t.anomaly.id for t in outbox.pending] == ["during"]  # its publish is due
    finally:
        await redis.aclose()
