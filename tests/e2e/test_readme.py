"""The README's trainer block, as written, under two ``trainguard launch`` agents and the
control plane (4 gloo ranks, ``tests/e2e/readme_trainer.py``): a killed rank is replaced in
place, the survivors keep their processes, no step is lost, and the job finishes."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.conftest import wait_until
from tests.e2e.test_in_place import InPlaceCluster, running, survivors_kept
from trainguard.demo.cluster import Cluster

pytestmark = pytest.mark.timeout(420)
REPO = Path(__file__).parents[2]


class ReadmeCluster(InPlaceCluster):
    """The README's block instead of the toy trainer (the job is the README's)."""

    def launch_argv(self, host: str) -> list[str]:
        argv = Cluster.launch_argv(self, host)
        return [*argv[:argv.index("--") + 1], "tests.e2e.readme_trainer",
                "--steps", str(self.steps), "--step-time", "0.05"]

    def env(self) -> dict[str, str]:
        env = super().env()
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        return env


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[ReadmeCluster]:
    c = ReadmeCluster(tmp_path, "llama-8b", [])
    async with running(c):
        yield c


async def test_the_readme_loop_recovers_a_killed_rank_in_place(cluster: ReadmeCluster) -> None:
    c = cluster
    await wait_until(lambda: c.observer.max_step >= 20, timeout=60, what="step 20")
    await c.drill("kill", 2)
    inc = await wait_until(lambda: c.incident(lambda i: i.status == "resolved"),
                           timeout=150, interval=0.5, what="the incident resolved")
    await c.finished()
    assert inc.cause == "process_crash", inc
    assert inc.recovery is not None and inc.recovery.path == "in_place", inc.recovery
    assert inc.steps_lost == 0 and inc.recovery.back_at is not None, inc
    survivors_kept(c, {2})
    print(f"README loop: back in {inc.recovery.seconds:.2f} s, "
          f"{inc.steps_lost} steps lost, phases {inc.recovery.phases}")
