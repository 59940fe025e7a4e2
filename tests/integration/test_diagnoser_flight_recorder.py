"""The diagnoser service names a hang's culprits from the agents' flight-recorder reports,
on real NATS and Redis, with the real 16-rank fixture dumps."""

from __future__ import annotations

import time
from typing import Any

from tests.conftest import wait_until
from tests.integration.diagnoses import diagnoser_settings, diagnoses
from tests.integration.recorder import running
from tests.unit.test_flightrec import FIXTURES, faulted
from trainguard.analysis import flightrec
from trainguard.contract.evidence import FlightRecorderEvidence, HangEvidence
from trainguard.contract.schemas import Anomaly, FlightRecorderReport
from trainguard.contract.subjects import Subjects
from trainguard.runtime.bus import Bus
from trainguard.services.diagnoser.service import DiagnoserService

SET = "gpu_error_1st"


async def test_agents_dumps_name_the_culprits_of_a_hang(nats_url: str, redis_url: str,
                                                        prefix: str, job: str,
                                                        nc: Any) -> None:
    s = Subjects(prefix)
    settings = diagnoser_settings(nats_url, redis_url, prefix)
    got = await diagnoses(nc, s, job)

    records = {r.rank: r for r in flightrec.read_dir(str(FIXTURES / SET))}
    svc = DiagnoserService(settings)
    async with running(svc):
        bus = Bus(nc, s, source="test")
        now = time.time()
        await bus.publish_durable(s.event(job, "anomaly"), Anomaly(
            id="hang-1", job=job, kind="hang", ranks=list(range(16)),
            hosts=["node-a", "node-b"], onset_at=now - 30, detected_at=now,
            evidence=HangEvidence(majority_phase="comm")))
        await wait_until(lambda: got, what="the hang's first diagnosis")
        for host, ranks in (("node-a", range(8)), ("node-b", range(8, 16))):
            await bus.publish_durable(s.fr(job, host), FlightRecorderReport(
                id=f"fr-{host}", job=job, host=host, time=time.time(),
                evidence=FlightRecorderEvidence(asked=list(ranks),
                                                records=[records[r] for r in ranks])))
        await wait_until(lambda: any(d.rev > 1 for d in got), timeout=30,
                         what="the diagnosis updated from the dumps")
    first, updated = got[0], got[-1]
    assert first.cause == "network"
    assert updated.id == first.id and updated.cause == "rank_hang"
    assert updated.ranks == faulted(SET) and updated.hosts == ["node-b"]
    assert any(e.source == "flight_recorder" for e in updated.evidence)
