"""The chaos suite: the demo's fault schedule against one real 4-rank job on two agents.

One cluster per module (control plane, node-a and node-b, a small transformer LM with
checkpoints). A clean stretch first must raise no anomaly; then each fault of docs/design.md
section 6 plays in turn on the same job, and each test asserts detection (kind and
culprit), cause, actions and recovery. Node-b's isolation (XID 79) comes last because it
shrinks the job.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tests.conftest import wait_until
from trainguard.demo.cluster import Cluster
from trainguard.demo.runner import Runner
from trainguard.demo.scenario import DEFAULT_SCHEDULE, FAULTS
from trainguard.runtime.telemetry import read_spans

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def runner(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Runner]:
    workdir: Path = tmp_path_factory.mktemp("chaos")
    cluster = Cluster(workdir, "chaos", steps=1_000_000, step_time=0.05, ckpt_every=10)
    try:
        await cluster.start(timeout=300)  # 4 ranks importing torch on a loaded machine
        yield Runner(cluster)
    finally:
        await cluster.stop()


# Generous on purpose: the suite must hold on a loaded machine (issue 16), where the cluster
# alone can take two minutes to start and a restart several more. Each fault may first
# wait for the previous one to be over (180 s), then run its own course (300 s).
SLOW_MACHINE_TIMEOUT = 540


@pytest.mark.timeout(SLOW_MACHINE_TIMEOUT)
async def test_a_clean_run_raises_no_anomaly(runner: Runner) -> None:
    start = runner.obs.max_step
    await wait_until(lambda: runner.obs.max_step >= start + 150, timeout=200,
                     what="150 clean steps")
    assert [a.kind for a in runner.obs.anomalies] == []
    assert any(c.status == "committed" for c in runner.obs.checkpoints)


@pytest.mark.timeout(SLOW_MACHINE_TIMEOUT)
@pytest.mark.parametrize("name", DEFAULT_SCHEDULE)
async def test_fault(runner: Runner, name: str) -> None:
    out = await runner.play(FAULTS[name])
    assert out.ok, (out.problems, runner.cluster.observer.timeline[-25:])


@pytest.mark.timeout(SLOW_MACHINE_TIMEOUT)
async def test_the_job_survived_everything(runner: Runner) -> None:
    # Every incident ends: one the last fault set off may still be settling (its restart
    # done, training not yet past its failure step).
    def still_open() -> list[object]:
        return [i for i in runner.obs.incidents.values() if i.status in ("open", "mitigating")]

    try:
        await wait_until(lambda: not still_open(), timeout=300, interval=0.5,
                         what="every incident over")
    except AssertionError:
        assert still_open() == []
    # Still training after everything: more steps complete. How fast is the benchmark's
    # question (bench/bench_recovery.py measures goodput): a fixed goodput floor here failed
    # on a loaded machine, where every restart re-imports torch slowly, for no fault of ours.
    start = runner.obs.max_step
    await wait_until(lambda: runner.obs.max_step >= start + 10, timeout=120,
                     what="10 more steps after the last fault")
    assert runner.cluster.procs["node-a"].poll() is None
    print(f"goodput over the suite: {runner.goodput():.3f}")


async def test_each_incident_is_one_trace_across_services(runner: Runner) -> None:
    spans = read_spans(str(runner.cluster.spans_path))
    by_trace: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        by_trace.setdefault(span["context"]["trace_id"], []).append(span)
    # A restart that ran (a skipped one, after an escalation or a rollback in place,
    # sends no command to an agent).
    restarted = [t for t in by_trace.values()
                 if any(s["name"] == "act restart"
                        and s["attributes"].get("trainguard.outcome") == "done" for s in t)]
    assert restarted, "no trace holds a restart that ran"
    trace = max(restarted, key=len)
    names = {s["name"] for s in trace}
    services = {s["resource"]["attributes"]["service.name"] for s in trace}
    assert any(n.startswith("publish") and n.endswith(".event.anomaly") for n in names)  # detector
    assert any(n.startswith("process") and n.endswith(".event.anomaly") for n in names)  # diagnoser
    assert any(n.startswith("decide ") for n in names)  # remediator
    assert any(s.startswith("trainguard-agent") for s in services), services  # agent
