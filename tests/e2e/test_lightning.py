"""``trainguard.lightning`` end to end: Lightning's DDP over gloo, 4 ranks under two agents
(``trainguard.examples.lightning_trainer``); a killed rank restarts the group from the
newest committed Lightning checkpoint (``tests/e2e/frameworks.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.e2e.frameworks import FrameworkCluster, crash_and_resume
from tests.e2e.test_in_place import running
from trainguard.lightning import CHECKPOINT_FILE

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[FrameworkCluster]:
    c = FrameworkCluster(tmp_path, "lit", "trainguard.examples.lightning_trainer", steps=100)
    async with running(c):
        yield c


async def test_a_killed_lightning_rank_restarts_from_the_committed_checkpoint(
        cluster: FrameworkCluster) -> None:
    await crash_and_resume(cluster, 1, CHECKPOINT_FILE)

