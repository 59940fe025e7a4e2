"""``trainguard.lightning`` end to end: Lightning's DDP over gloo, 4 ranks under two agents
(``trainguard.examples.lightning_trainer``); a killed rank restarts the group from the
newest committed Lightning checkpoint (``tests/e2e/frameworks.py``); a NaN restarts it
from a checkpoint before the onset."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.conftest import wait_until
from tests.e2e.frameworks import CKPT_EVERY, FrameworkCluster, crash_and_resume
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


async def test_a_nan_in_a_lightning_job_restarts_it_from_before_the_onset(
        cluster: FrameworkCluster) -> None:
    """The rollback's ``reload`` cannot run in Lightning's loop (it is not ``guard.steps``):
    the ranks say so, and the remediator's restart resumes from the pointer the rollback
    moved below the onset."""
    c = cluster
    await wait_until(lambda: any(k.status == "committed" for k in c.observer.checkpoints)
                     and c.observer.max_step >= 2 * CKPT_EVERY + 2, timeout=180,
                     what="a committed checkpoint and training past it")
    await c.drill("nan", 0)
    inc = await wait_until(lambda: c.incident(lambda i: i.status == "resolved"),
                           timeout=240, interval=0.5, what="the incident resolved")
    await c.finished(timeout=300)
    assert inc.cause == "numeric", c.story()
    assert [a.action for a in inc.actions if a.status == "done"][:1] == ["rollback"], inc
    assert inc.recovery is not None and inc.recovery.path == "restart", inc.recovery
    assert inc.resume_step is not None and inc.failure_step is not None, inc
    assert inc.resume_step < inc.failure_step, inc  # from before the NaN, not after it
    assert c.observer.max_step == c.steps - 1
