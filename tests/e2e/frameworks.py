"""A framework's trainer (Lightning, the Hugging Face Trainer) under two ``trainguard launch``
agents and the control plane (4 gloo ranks): a killed rank restarts the group (the
framework owns its process group, so no rank recovers in place), which goes on from the
newest committed checkpoint the framework wrote, and the job finishes."""

from __future__ import annotations

import time
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
        self.step_time, self.ckpt_every = 0.05, CKPT_EVERY

    def launch_argv(self, host: str) -> list[str]:
        return Cluster.launch_argv(self, host)  # not the toy trainer's in-place flags


async def crash_and_resume(c: FrameworkCluster, rank: int, own_file: str) -> Incident:
    """Kill ``rank`` once a checkpoint (holding the framework's ``own_file``) is committed
    and training is past it; returns the incident, resolved, once the job finished.

    Asserts what every framework must do: the culprit named, the whole group restarted and
    back from the newest committed checkpoint (the restarted group's own ``resume`` report;
    not the ranks' pids, which a heartbeat may not have shown before a kill that soon), at
    most an interval and the steps run while the kill travelled lost, every step run."""
    job_dir = c.workdir / "ckpt" / c.job
    committed = await wait_until(
        lambda: [k for k in c.observer.checkpoints if k.status == "committed"],
        timeout=180, interval=0.2, what="a committed checkpoint")
    first = committed[0]
    assert Path(first.path) == job_dir / f"step-{first.step}", first
    assert (Path(first.path) / own_file).exists()  # the framework's own files
    await wait_until(lambda: c.observer.max_step >= first.step + 2, timeout=60,
                     what="training past the checkpoint")
    newest = max(k.step for k in c.observer.checkpoints if k.status == "committed")
    await c.drill("kill", rank)
    killed_at = time.monotonic()
    inc = await wait_until(lambda: c.incident(lambda i: i.status == "resolved"),
                           timeout=240, interval=0.5, what="the incident resolved")
    resolved = time.monotonic() - killed_at
    await c.finished(timeout=300)
    assert inc.cause == "process_crash", c.story()
    assert inc.ranks == [rank], inc
    assert inc.recovery is not None and inc.recovery.path == "restart", inc.recovery
    note = inc.recovery  # the restarted group's own report: the whole group restarted
    assert note.kind == "resume" and note.resumed_step is not None, note
    loaded = note.resumed_step - 1
    assert loaded >= newest and (job_dir / f"step-{loaded}" / "COMMITTED").exists(), note
    assert inc.failure_step is not None, inc
    lost = inc.failure_step - loaded
    assert 0 <= lost <= CKPT_EVERY + 5, (inc.failure_step, loaded)
    assert (inc.resume_step, inc.steps_lost) == (loaded, lost), inc  # the group's word
    assert c.observer.max_step == c.steps - 1, c.observer.max_step
    print(f"{c.job}: resolved {resolved:.1f} s after the kill; failed at step "
          f"{inc.failure_step}, loaded step {loaded}: {lost} steps lost; back in "
          f"{note.seconds} s, phases {note.phases}")
    return inc
