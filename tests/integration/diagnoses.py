"""What the diagnoser's integration tests share: its settings on the test's servers, and the
diagnoses it publishes for a job, as they arrive."""

from __future__ import annotations

from typing import Any

from trainguard.contract.codec import decode_durable
from trainguard.contract.schemas import Diagnosis
from trainguard.contract.subjects import Subjects
from trainguard.runtime.config import load_settings
from trainguard.services.diagnoser.settings import DiagnoserSettings


def diagnoser_settings(nats_url: str, redis_url: str, prefix: str) -> DiagnoserSettings:
    return load_settings(DiagnoserSettings, env={}, overrides={
        "nats_url": nats_url, "redis_url": redis_url, "prefix": prefix})


async def diagnoses(nc: Any, subjects: Subjects, job: str) -> list[Diagnosis]:
    """A list the job's diagnosis events are appended to (subscribed before it returns)."""
    got: list[Diagnosis] = []

    async def on_diag(msg: Any) -> None:
        got.append(decode_durable(msg.data, Diagnosis))

    await nc.subscribe(subjects.event(job, "diagnosis"), cb=on_diag)
    return got
