"""Flight-recorder dumps from a real hung gloo job on CPU: the agent's request reaches the
blocked ranks (their watcher thread dumps while the main thread waits in the collective),
the agent collects the dumps, and the analysis names the rank that stopped short."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from tests.conftest import wait_until
from tests.e2e.conftest import job_env, torchrun
from trainguard.agent import flightrec as agent_fr
from trainguard.analysis import flightrec
from trainguard.contract import envnames

NPROC = 3


async def test_dumps_of_a_hung_gloo_job_name_the_rank_that_stopped(
        tmp_path: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    prefix = str(tmp_path / "nccl_trace_rank_")
    env = job_env("nats://127.0.0.1:1", "tg", TORCH_FR_BUFFER_SIZE="200",
                  TORCH_FR_DUMP_TEMP_FILE=prefix,
                  **{envnames.FR_REQUEST: agent_fr.request_path(str(tmp_path))})
    job = torchrun(NPROC, ["--dir", str(tmp_path), "--culprit", "1"], env,
                   tmp_path / "job.log", module="tests.e2e.fr_hang_trainer")
    procs.append(job)
    ready = [tmp_path / f"ready{r}" for r in range(NPROC)]
    await wait_until(lambda: all(p.exists() for p in ready) or job.poll() is not None,
                     timeout=120, interval=0.2, what="every rank past its warm-up steps")
    assert job.poll() is None, (tmp_path / "job.log").read_text()[-3000:]
    pids = {r: int(p.read_text()) for r, p in enumerate(ready)}

    evidence = agent_fr.collect(str(tmp_path), prefix, pids, stopped=set(), timeout=60)
    assert [r.rank for r in evidence.records] == list(range(NPROC))
    a = flightrec.analyse(evidence.records, expected=evidence.asked, scope=evidence.asked)
    assert a.culprits == [1], flightrec.render(a)
    assert "0" in a.culprit_groups()  # the default group waits for rank 1

    # A rank that cannot answer (SIGSTOP) is missing, and still the one the others wait on.
    os.kill(pids[1], signal.SIGSTOP)
    try:
        again = agent_fr.collect(str(tmp_path), prefix, pids, stopped={1}, timeout=60)
        b = flightrec.analyse(again.records, expected=again.asked, scope=again.asked)
        assert [r.rank for r in again.records] == [0, 2]
        assert b.missing == [1] and b.culprits == [1], flightrec.render(b)
    finally:
        os.kill(pids[1], signal.SIGCONT)
