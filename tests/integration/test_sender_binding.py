"""Telemetry and reports bound to the sender their subject names, against real servers.

NATS permissions bind a credential to subjects, not to what a body says: a body that names
another rank, host or job than its subject is dead-lettered with the reason and counted,
and reaches no rule (the detector would otherwise judge a forged NaN in a rank's name).
"""

from __future__ import annotations

import time
from typing import Any

from tests.integration.test_detector_service import (
    detecting,
    of,
    settings,
    until,
    worker_exit,
)
from tests.integration.test_service import collect_dead
from trainguard.contract.codec import decode_telemetry
from trainguard.contract.schemas import StepReport
from trainguard.contract.subjects import Subjects
from trainguard.runtime.bus import Bus
from trainguard.services.detector.service import DetectorService


def report(job: str, rank: int, step: int, loss: float) -> StepReport:
    return StepReport(job=job, time=time.time(), seq=step, rank=rank, step=step,
                      duration=0.05, loss=loss, grad_norm=1.0, tokens=1024)


async def test_a_step_report_in_another_ranks_name_is_dead_lettered_and_judged_by_none(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any) -> None:
    svc = DetectorService(settings(nats_url, redis_url, prefix))
    dead = await collect_dead(nc, prefix, job)
    async with detecting(svc, nc, job) as (ranks, seen):
        await ranks.steps(5)
        s, step = ranks.s, ranks.step
        # Step ``step``: ranks 0, 1 and 3 report; rank 1's connection forges rank 2's NaN.
        for r in (0, 1, 3):
            await ranks.bus.publish_telemetry(s.step(job, r), report(job, r, step, 2.0))
        await ranks.bus.publish_telemetry(s.step(job, 1), report(job, 2, step, float("nan")))
        await until(lambda: dead, what="the forged report's dead letter")
        [letter] = dead
        assert letter.subject == s.step(job, 1) and letter.service == "detector"
        assert "rank 2" in letter.reason and "rank 1" in letter.reason
        assert decode_telemetry(letter.payload).rank == 2
        rt = svc.runtime
        assert rt.metrics.dead.labels("detector", "misaddressed")._value.get() == 1
        assert rt.metrics.telemetry.labels("detector", "misaddressed")._value.get() == 1
        # Rank 2's own report closes the step; its NaN one step later is judged: the
        # forged one, seen before both on one connection, never was.
        await ranks.bus.publish_telemetry(s.step(job, 2), report(job, 2, step, 2.0))
        for r in ranks.ranks:
            await ranks.bus.publish_telemetry(s.step(job, r), report(
                job, r, step + 1, float("nan") if r == 3 else 2.0))
        await until(lambda: of(seen, "nonfinite"), what="rank 3's own NaN judged")
        [nonfinite] = of(seen, "nonfinite")
        assert nonfinite.ranks == [3] and nonfinite.step == step + 1


async def test_a_worker_exit_for_another_host_is_dead_lettered_and_raises_no_crash(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any) -> None:
    """The durable path (one settle for every consumer): an exit on host-0's subject
    that names host-1 is dead-lettered; the same exit on host-1's subject is a crash."""
    svc = DetectorService(settings(nats_url, redis_url, prefix))
    subjects = Subjects(prefix)
    dead = await collect_dead(nc, prefix, job)
    async with detecting(svc, nc, job) as (_, seen):
        bus = Bus(nc, subjects, source="test")
        forged = worker_exit(job, 3, "forged", exit_code=1, error="RuntimeError: boom")
        await bus.publish_durable(subjects.exit(job, "host-0"), forged)
        await until(lambda: [d for d in dead if d.consumer == "detector-exit"],
                    what="the forged exit's dead letter")
        [letter] = [d for d in dead if d.consumer == "detector-exit"]
        assert "host 'host-1'" in letter.reason and letter.subject == subjects.exit(job, "host-0")
        assert svc.runtime.metrics.dead.labels("detector", "misaddressed")._value.get() == 1
        await bus.publish_durable(subjects.exit(job, "host-1"), worker_exit(
            job, 3, "real", exit_code=1, error="RuntimeError: boom"))
        await until(lambda: of(seen, "crash"), what="the real exit's crash")
        assert [a.ranks for a in of(seen, "crash")] == [[3]]
