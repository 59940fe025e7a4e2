"""The Hugging Face Trainer under trainguard end to end: the control plane, two
``trainguard launch`` agents of 2 ranks each (4 gloo ranks of
``trainguard.examples.hf_trainer``, a tiny Llama with the ``trainguard.hf`` callback). A
killed rank makes the agents restart the group (HF ranks do not recover in place), the
Trainer resumes from the newest committed checkpoint it wrote, and the job finishes."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.conftest import wait_until
from tests.e2e.test_in_place import InPlaceCluster, running
from trainguard.demo.cluster import Cluster

pytestmark = pytest.mark.timeout(600)  # 4 ranks importing transformers twice on 2 cores
STEPS = 120
EVERY = 10


class HFCluster(InPlaceCluster):
    """The demo's two agents running the HF example trainer (restart recovery only)."""

    def launch_argv(self, host: str) -> list[str]:
        argv = Cluster.launch_argv(self, host)
        return [*argv[:argv.index("--") + 1], "trainguard.examples.hf_trainer",
                "--job", self.job, "--root", str(self.workdir / "ckpt"),
                "--steps", str(self.steps), "--step-time", "0.05",
                "--ckpt-every", str(self.ckpt_every)]


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[HFCluster]:
    c = HFCluster(tmp_path, "hf", [], steps=STEPS)
    async with running(c):
        yield c


async def test_a_killed_rank_restarts_the_trainer_from_its_committed_checkpoint(
        cluster: HFCluster) -> None:
    c = cluster
    job_dir = c.workdir / "ckpt" / c.job
    committed = await wait_until(
        lambda: [k for k in c.observer.checkpoints if k.status == "committed"],
        timeout=120, interval=0.2, what="a committed checkpoint")
    first = committed[0]
    assert Path(first.path) == job_dir / f"step-{first.step}", first
    assert (Path(first.path) / "trainer_state.json").exists()  # the Trainer's own files
    newest = max(k.step for k in c.observer.checkpoints if k.status == "committed")
    await c.drill("kill", 1)
    killed_at = time.monotonic()
    inc = await wait_until(lambda: c.incident(lambda i: i.status == "resolved"),
                           timeout=240, interval=0.5, what="the incident resolved")
    back = time.monotonic() - killed_at
    await c.finished(timeout=240)
    assert inc.cause == "process_crash", c.story()
    assert 1 in inc.ranks, inc
    assert inc.recovery is not None and inc.recovery.path == "restart", inc.recovery
    assert all(len(c.pids[r]) >= 2 for r in range(4)), c.pids  # the whole group restarted
    # Back from a committed checkpoint (the restarted group's own report): at most one
    # interval, and the steps run while the kill travelled, lost.
    note = inc.recovery
    assert note.kind == "resume" and note.resumed_step is not None, note
    loaded = note.resumed_step - 1
    assert loaded >= newest and (job_dir / f"step-{loaded}" / "COMMITTED").exists(), note
    assert inc.failure_step is not None, inc
    lost = inc.failure_step - loaded
    assert 0 <= lost <= EVERY + 5, (inc.failure_step, loaded)
    assert c.observer.max_step == STEPS - 1, c.observer.max_step
    print(f"HF trainer: resolved {back:.1f} s after the kill; failed at step "
          f"{inc.failure_step}, loaded step {loaded}: {lost} steps lost; back in "
          f"{note.seconds} s, phases {note.phases}")
