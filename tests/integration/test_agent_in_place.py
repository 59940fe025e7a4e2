"""The agent's in-place replacement with real processes on torch's real c10d rendezvous
and the group store the agent serves (real ``TCPStore`` on loopback): a rank that fails
in a group whose every rank declared in-place recovery is replaced alone (the survivor's
process runs on, the replacement joins the next generation from its peers at the same
attempt); a group that did not declare it restarts, and the agent says why. The ranks
are small scripts speaking the job store's keys (``trainguard.recovery.groupstore``) as
``trainguard.torch`` does, without a process group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.test_launcher_supervision import plan
from trainguard.agent.node import LocalNode
from trainguard.agent.rendezvous import JobRendezvous
from trainguard.agent.settings import AgentSettings
from trainguard.agent.spares import SparePool
from trainguard.agent.supervisor import Program, Supervisor
from trainguard.contract.schemas import RecoveryReport, WorkerExit
from trainguard.runtime.config import load_settings
from trainguard.runtime.embedded import free_port

RANK = r'''
import json, os, sys, time
from datetime import timedelta
import torch.distributed as dist
from trainguard.recovery import groupstore
env, out, mode = os.environ, sys.argv[1], sys.argv[2]
declare = mode == "declare"
store = dist.PrefixStore(groupstore.job_prefix(env["TORCHELASTIC_RUN_ID"]), dist.TCPStore(
    env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
    timeout=timedelta(seconds=60)))
rank, gen = int(env["RANK"]), int(env["TRAINGUARD_GENERATION"])
seen = {k: env.get(k, "") for k in ("TRAINGUARD_JOIN", "TRAINGUARD_GENERATION",
                                     "TORCHELASTIC_RESTART_COUNT",
                                     "TORCHELASTIC_USE_AGENT_STORE")}
seen["store_generation"] = store.add(groupstore.GENERATION, 0)
with open(os.path.join(out, f"rank{rank}-{os.getpid()}.json"), "w") as fh:
    json.dump(seen, fh)
if declare:
    store.set(groupstore.in_place_key(gen, rank), "1")
store.set(f"test/seen/{gen}/{rank}", "1")
if rank == 1:
    if env.get("TRAINGUARD_JOIN"):
        sys.exit(0)  # the replacement: joined, done
    store.wait([f"test/seen/{gen}/0"])
    if mode == "marked":  # as another node's agent does before a command's group restart
        store.set(groupstore.restart_key(gen), "cmd-7")
    sys.exit(3)  # the fault, once rank 0 is up
deadline = time.time() + 90
while time.time() < deadline:  # rank 0: waits for the replacement's generation
    g = store.add(groupstore.GENERATION, 0)
    if g > gen and store.check([groupstore.in_place_key(g, 1)]):
        sys.exit(0)
    time.sleep(0.05)
sys.exit(4)
'''


def supervise(tmp_path: Path, mode: str, max_restarts: int
              ) -> tuple[int, list[WorkerExit], list[RecoveryReport], list[dict[str, str]]]:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    exits: list[WorkerExit] = []
    reports: list[RecoveryReport] = []
    settings = load_settings(AgentSettings, env={}, overrides={"job": "j", "host": "node-a"})
    node = LocalNode(settings, hosts_store=True, gpu=None, publish_exit=exits.append)
    node.publish_recovery = reports.append
    rdzv = JobRendezvous(plan(f"127.0.0.1:{free_port()}", 1, host=True))
    sup = Supervisor(node=node, rdzv=rdzv, program=Program(str(script), [str(tmp_path), mode]),
                     nproc=2, max_restarts=max_restarts, log_dir=str(tmp_path / "logs"),
                     spares=SparePool(0, {}, str(tmp_path)), stop_grace=5.0)
    code = sup.run()
    seen = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"),
                                                      key=lambda p: p.stat().st_mtime)]
    return code, exits, reports, seen


@pytest.fixture(params=["agent-served", "shared"])
def store_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``launch()``'s setting (the agent serves a group store per round), and torch's own
    sharing of its rendezvous store with the ranks."""
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
                       "1" if request.param == "agent-served" else "0")
    return str(request.param)


@pytest.mark.timeout(180)
def test_one_failed_rank_of_a_declaring_group_is_replaced_in_place(
        tmp_path: Path, store_mode: str) -> None:
    (tmp_path / "logs").mkdir()
    code, exits, reports, _ = supervise(tmp_path, "declare", 5)
    assert code == 0
    ranks0 = list(tmp_path.glob("rank0-*.json"))
    assert len(ranks0) == 1  # the survivor never restarted
    first, joined = (json.loads(p.read_text()) for p in sorted(
        tmp_path.glob("rank1-*.json"), key=lambda p: p.stat().st_mtime))
    assert first["TRAINGUARD_JOIN"] == "" and joined["TRAINGUARD_JOIN"] == "peers"
    assert int(joined["TRAINGUARD_GENERATION"]) == int(first["TRAINGUARD_GENERATION"]) + 1
    assert joined["store_generation"] == int(joined["TRAINGUARD_GENERATION"])
    assert joined["TORCHELASTIC_RESTART_COUNT"] == first["TORCHELASTIC_RESTART_COUNT"]
    assert first["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    fault = [e for e in exits if e.exit_code == 3]
    assert [(e.rank, e.initiated_by, e.generation) for e in fault] == [
        (1, None, int(first["TRAINGUARD_GENERATION"]))]
    assert [(r.path, r.rank, r.joined, r.source_rank) for r in reports] == [
        ("in_place", 1, [1], None)]  # the agent's word: replaced; nothing fell back
    assert reports[0].generation == int(joined["TRAINGUARD_GENERATION"])
    assert all(e.exit_code == 0 for e in exits if e is not fault[0])


@pytest.mark.timeout(180)
def test_a_group_that_did_not_declare_restarts_and_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    (tmp_path / "logs").mkdir()
    code, _, reports, seen = supervise(tmp_path, "plain", 1)
    assert code == 1  # rank 1 fails on every start; one restart allowed
    assert len(list(tmp_path.glob("rank0-*.json"))) == 2  # the group restarted once
    assert [r.path for r in reports] == ["restart", "restart"]
    assert "did not declare in-place recovery" in reports[0].reason
    assert "no restarts left" in reports[1].reason
    assert all(r.rank == 1 and r.world_size == 2 for r in reports)
    assert all(s["TRAINGUARD_JOIN"] == "" for s in seen)


@pytest.mark.timeout(180)
def test_a_rank_that_fails_after_a_commanded_group_restart_is_the_commands(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another node's agent stopped its ranks for a command's group restart (its mark is
    in the group store): a rank here that fails on its lost peers is that command's, not
    a crash of its own, and nothing falls back."""
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    (tmp_path / "logs").mkdir()
    code, exits, reports, _ = supervise(tmp_path, "marked", 1)
    assert code == 1  # rank 1 fails on every start; one restart allowed
    fault = [e for e in exits if e.exit_code == 3]
    assert [(e.rank, e.initiated_by) for e in fault] == [(1, "cmd-7"), (1, "cmd-7")]
    assert reports == []
