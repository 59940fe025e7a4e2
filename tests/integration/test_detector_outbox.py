"""The detector's outbox against a real Redis: a job taken back while the anomaly changes of
a Redis outage are still pending starts from them (an anomaly opened during the outage is
open, one resolved during it is not), so nothing opened stays open for good; and a job's
records are written only under its lease."""

from __future__ import annotations

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter

from trainguard.contract.schemas import Anomaly
from trainguard.runtime.lease import LeaseHolder
from trainguard.runtime.state import Keys
from trainguard.services.detector.book import Transition, dump_anomaly
from trainguard.services.detector.leases import ROLE
from trainguard.services.detector.outbox import AnomalyOutbox
from trainguard.services.detector.writebehind import Outage, WriteBehind


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
        open_ = (await outbox.load(job, settle=1.0)).open
        assert sorted(open_) == ["hang:during"]
        assert [t.anomaly.id for t in outbox.pending] == ["during"]  # its publish is due
    finally:
        await outbox.writes.close(1.0)
        await redis.aclose()


async def test_a_jobs_records_are_written_only_under_its_lease(
        redis_url: str, prefix: str, job: str) -> None:
    """Ours: written. Another detector's: dropped, never over its records. Nobody's:
    pending until we hold it again."""
    redis = aioredis.from_url(redis_url, decode_responses=True)
    keys = Keys(prefix)
    me = LeaseHolder(redis, "detector-a", 30.0)
    writes = WriteBehind(redis, Outage("Redis"), holder=lambda: me)
    record, lease = keys.dedupe(ROLE, job), keys.lease(ROLE, job)
    writes.fences[record] = lease

    async def write(field: str) -> None:
        writes.pending.set(record, field, dump_anomaly(hang(job, field)))
        await writes.settle(5.0)

    try:
        assert await me.acquire(lease)
        await write("ours")
        assert await redis.hexists(record, "ours")
        await redis.set(lease, "detector-b")  # the job moved while we were away
        await write("theirs")
        assert not await redis.hexists(record, "theirs") and writes.fenced_out == 1
        assert len(writes.pending) == 0  # dropped: the new owner's records win
        await redis.delete(lease)  # nobody holds it
        await write("nobodys")
        assert not await redis.hexists(record, "nobodys")
        assert writes.unwritten(record).keys() == {"nobodys"}  # kept for a take-back
        assert await me.acquire(lease)
        await writes.settle(5.0)
        assert await redis.hexists(record, "nobodys")
    finally:
        await writes.close(1.0)
        await redis.aclose()
