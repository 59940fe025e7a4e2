"""``trainguard.hf`` end to end: the Hugging Face Trainer over gloo, 4 ranks under two
agents (``trainguard.examples.hf_trainer``, a tiny Llama); a killed rank restarts the group
from the newest committed Trainer checkpoint (``tests/e2e/frameworks.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.e2e.frameworks import FrameworkCluster, crash_and_resume
from tests.e2e.test_in_place import running

pytestmark = pytest.mark.timeout(600)  # 4 ranks importing transformers twice on 2 cores


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[FrameworkCluster]:
    c = FrameworkCluster(tmp_path, "hf", "trainguard.examples.hf_trainer", steps=120)
    async with running(c):
        yield c


async def test_a_killed_rank_restarts_the_trainer_from_its_committed_checkpoint(
        cluster: FrameworkCluster) -> None:
    await crash_and_resume(cluster, 1, "trainer_state.json")
