"""A framework's trainer (Lightning, the Hugging Face Trainer) under two ``trainguard launch``
agents and the control plane (4 gloo ranks): a killed rank restarts the group, which goes
on from the newest committed checkpoint the framework wrote, and the job finishes."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import wait_until
from tests.e2e.test_in_place import InPlaceCluster
from trainguard.contract.schemas import Incident
from trainguard.demo.cluster import Cluster

CKPT_EVERY = 10


class FrameworkCluster(InPlaceCluster):
    """The demo's cluster running ``module`` (a trainer taking ``--job --root --steps
    --step-time --ckpt-every``) instead of the toy trainer."""

    def __init__(self, workdir: Path, job: str, module: str, steps: int) -> None:
        super().__init__(workdir, job, [], steps=steps)
        self.trainer_argv = [module]
        self.step_time, self.ckpt_every = 0.1, CKPT_EVERY

    def launch_argv(self, host: str) -> list[str]:
        return Cluster.launch_argv(self, host)  # not the toy trainer's in-place flags


async def crash_and_resume(c: FrameworkCluster, rank: int) -> Incident:
    """Kill ``rank`` once a checkpoint is committed; the incident, resolved, once the job
    finished. Asserts what every framework must do: the culprit named, the group restarted
    and resumed from a committed checkpoint (not step 0), every step run."""
    await wait_until(lambda: any(k.status == "committed" for k in c.observer.checkpoints)
                     and c.observer.max_step >= 2 * CKPT_EVERY + 2, timeout=180,
                     what="a committed checkpoint and training past it")
    await c.drill("kill", rank)
    await wait_until(lambda: c.incident(lambda i: i.status == "resolved") is not None,
                     timeout=240, interval=0.5, what="the incident resolved")
    await c.finished(timeout=300)
    inc = c.incident(lambda i: i.status == "resolved")
    assert inc is not None and inc.cause == "process_crash", c.story()
    assert inc.ranks == [rank], inc
    assert inc.recovery is not None and inc.recovery.path == "restart", inc.recovery
    [resume] = [r for r in c.recoveries if r.kind == "resume"]
    committed = sorted(k.step for k in c.observer.checkpoints if k.status == "committed")
    assert resume.resumed_step - 1 in committed and resume.resumed_step > CKPT_EVERY, \
        (resume, committed)
    assert inc.steps_lost is not None and inc.steps_lost <= 2 * CKPT_EVERY, inc
    assert c.observer.max_step == c.steps - 1, c.observer.max_step
    return inc
