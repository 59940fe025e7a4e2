"""``trainguard.lightning`` end to end: Lightning's DDP over gloo, 4 ranks under two agents
(``trainguard.examples.lightning_trainer``); a killed rank restarts the group from the
newest committed Lightning checkpoint."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.e2e.frameworks import FrameworkCluster, crash_and_resume
from tests.e2e.test_in_place import running

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[FrameworkCluster]:
    c = FrameworkCluster(tmp_path, "lit", "trainguard.examples.lightning_trainer", steps=80)
    async with running(c):
        yield c


async def test_a_killed_lightning_rank_restarts_from_the_committed_checkpoint(
        cluster: FrameworkCluster) -> None:
    inc = await crash_and_resume(cluster, 1)
    assert inc.recovery is not None
    print(f"Lightning: back in {inc.recovery.seconds:.2f} s, {inc.steps_lost} steps lost, "
          f"phases {inc.recovery.phases}")
