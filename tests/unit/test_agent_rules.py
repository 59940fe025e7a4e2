"""The agent's pure parts: command rules, torchrun defaults, GPU sources."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from trainguard import Guard
from trainguard.agent.executor import CommandExecutor
from trainguard.agent.exitcodes import EXIT_HELD
from trainguard.agent.gpu import ScriptedSource, open_source, throttle_names
from trainguard.agent.launcher import prepare_torchrun, worker_environment
from trainguard.agent.node import FLIGHT_RECORDER_PREFIX, Failure, LocalNode, Worker
from trainguard.agent.settings import AgentSettings
from trainguard.contract import envnames
from trainguard.contract.envnames import setting
from trainguard.contract.schemas import Command, GpuStats, WorkerExit
from trainguard.contract.subjects import Subjects
from trainguard.contract.targets import addressed, for_agent
from trainguard.core.auth import generate, write_credentials
from trainguard.runtime.config import load_settings


@dataclass
class FakeNode:
    """A stand-in for the local worker table (the executor's only collaborator)."""

    host: str = "node-b"
    hosts_store: bool = False
    drills_allowed: bool = True
    calls: list[str] = field(default_factory=list)
    pids: dict[int, int] = field(default_factory=lambda: {2: 1002, 3: 1003})

    def rank_pids(self) -> dict[int, int]:
        return dict(self.pids)

    def restart(self, command_id: str) -> str:
        self.calls.append(f"restart:{command_id}")
        return "restarted"

    def restart_rank(self, rank: int, command_id: str, fallback: str = "") -> str:
        self.calls.append(f"restart:{rank}:{command_id}" + (f":{fallback}" if fallback else ""))
        return f"rank {rank} restarted alone"

    def isolate(self, command_id: str) -> str:
        self.calls.append(f"isolate:{command_id}")
        return "isolated"

    def stop(self, command_id: str) -> str:
        self.calls.append("stop")
        return "stopped"

    def hold(self, command_id: str) -> str:
        self.calls.append(f"hold:{command_id}")
        return "held"

    def dump(self, ranks: list[int]) -> str:
        self.calls.append(f"dump:{ranks}")
        return "stacks"

    def signal_rank(self, rank: int, action: str) -> str:
        self.calls.append(f"{action}:{rank}")
        return f"{action} {rank}"

    def gpu_drill(self, kind: str, params: dict[str, object]) -> str:
        self.calls.append(f"gpu:{kind}")
        return kind

    def preflight_summary(self, checks: list[str] | None) -> str:
        self.calls.append(f"preflight:{checks}")
        return "preflight ok"


def cmd(ident: str, kind: str, **kw: object) -> Command:
    return Command(id=ident, job="j", kind=kind, issuer="remediator", **kw)  # type: ignore[arg-type]


def test_each_command_runs_once_in_order() -> None:
    node = FakeNode()
    ex = CommandExecutor(node)
    assert ex.handle(cmd("a", "restart")).outcome == "done"  # type: ignore[union-attr]
    assert ex.handle(cmd("a", "restart")) is None  # redelivered
    retry = ex.handle(cmd("b", "restart", retry_of="a"))
    assert retry is not None and retry.detail == "already done as a"
    assert node.calls == ["restart:a"]


def test_a_restart_naming_a_rank_restarts_that_rank_alone() -> None:
    node = FakeNode()
    ex = CommandExecutor(node)
    one = ex.handle(cmd("r1", "restart", params={"rank": 3}))
    assert one is not None and (one.outcome, one.detail) == ("done", "rank 3 restarted alone")
    elsewhere = ex.handle(cmd("r2", "restart", params={"rank": 0}))  # not on node-b
    assert elsewhere is not None and elsewhere.outcome == "refused"
    assert ex.handle(cmd("r3", "restart")) is not None  # no rank: the whole group
    assert node.calls == ["restart:3:r1", "restart:r3"]


def test_a_culprit_restart_names_its_fallback() -> None:
    node = FakeNode()
    ex = CommandExecutor(node)
    group = ex.handle(cmd("g", "restart", params={"rank": 2, "fallback": "group"}))
    assert group is not None and group.outcome == "done"
    bad = ex.handle(cmd("b", "restart", params={"rank": 2, "fallback": "cluster"}))
    assert bad is not None and bad.outcome == "refused" and "params.fallback" in bad.detail
    assert node.calls == ["restart:2:g:group"]


def test_a_dump_naming_ranks_on_several_hosts_dumps_the_local_ones() -> None:
    """A hang's culprits 0 (node-a) and 2 (node-b): each host dumps its own, and is refused
    only when none runs there; a drill naming another host's rank is still refused."""
    node = FakeNode()
    ex = CommandExecutor(node)
    both = ex.handle(cmd("d1", "dump", params={"ranks": [0, 2]}))
    assert both is not None and both.outcome == "done"
    none = ex.handle(cmd("d2", "dump", params={"ranks": [0, 1]}))
    assert none is not None and none.outcome == "refused" and "[0, 1]" in none.detail
    kill = ex.handle(cmd("k", "kill", params={"ranks": [0, 2]}))
    assert kill is not None and kill.outcome == "refused"
    assert node.calls == ["dump:[2]"]


def test_rank_commands_are_not_the_agents() -> None:
    assert CommandExecutor(FakeNode()).handle(cmd("s", "save_now")) is None


def test_a_command_for_another_host_is_left_to_it() -> None:
    node = FakeNode(host="node-b")
    ex = CommandExecutor(node)
    _, other = addressed(Subjects(), "j", "restart", issuer="remediator", host="node-a")
    assert ex.handle(other) is None and node.calls == []
    _, mine = addressed(Subjects(), "j", "restart", issuer="remediator", host="node-b")
    ack = ex.handle(mine)
    assert ack is not None and (ack.responder, ack.outcome) == ("host-node-b", "done")
    assert node.calls == [f"restart:{mine.id}"]


def test_stale_epochs_are_refused() -> None:
    node = FakeNode()
    ex = CommandExecutor(node)
    ex.handle(cmd("new", "dump", epoch=5))
    out = ex.handle(cmd("old", "restart", epoch=4))
    assert out is not None and out.outcome == "refused" and "stale epoch 4 < 5" in out.detail
    assert node.calls == ["dump:[2, 3]"]


def test_drills_need_permission_and_a_local_rank() -> None:
    ex = CommandExecutor(FakeNode(drills_allowed=False))
    out = ex.handle(cmd("k", "kill", params={"rank": 2}))
    assert out is not None and out.outcome == "refused" and "--allow-drills" in out.detail
    node = FakeNode()
    ex = CommandExecutor(node)
    out = ex.handle(cmd("k2", "freeze", params={"rank": 7}))
    assert out is not None and out.outcome == "refused" and "local ranks: [2, 3]" in out.detail
    assert ex.handle(cmd("k3", "kill", params={"rank": 3})).outcome == "done"  # type: ignore[union-attr]
    assert node.calls == ["kill:3"]


def test_the_rendezvous_store_host_refuses_isolation() -> None:
    out = CommandExecutor(FakeNode(hosts_store=True)).handle(cmd("i", "isolate"))
    assert out is not None and out.outcome == "refused" and "rendezvous store" in out.detail
    node = FakeNode()
    assert CommandExecutor(node).handle(cmd("i", "isolate")).outcome == "done"  # type: ignore[union-attr]


@pytest.mark.parametrize("hosts_store", [True, False])
def test_a_hold_stops_every_host_once(hosts_store: bool) -> None:
    node = FakeNode(hosts_store=hosts_store)  # the store host too: the whole job ends
    ex = CommandExecutor(node)
    ex.handle(cmd("dump", "dump", epoch=5))
    _, hold = addressed(Subjects(), "j", "hold", issuer="remediator", everyone=True, epoch=5)
    ack = ex.handle(hold)
    assert ack is not None and (ack.outcome, ack.detail, ack.kind) == ("done", "held", "hold")
    assert ex.handle(hold) is None  # redelivered
    again = ex.handle(cmd("h2", "hold", epoch=5, retry_of=hold.id))
    assert again is not None and again.detail == f"already done as {hold.id}"
    stale = ex.handle(cmd("h3", "hold", epoch=4))  # a deposed leader's
    assert stale is not None and stale.outcome == "refused"
    assert node.calls == ["dump:[2, 3]", f"hold:{hold.id}"]
    assert for_agent("hold")  # the agent's kind: ranks on cmd.all leave it alone


def settings(**kw: object) -> AgentSettings:
    return load_settings(AgentSettings, env={}, overrides={"job": "j", "host": "node-a", **kw})


def test_torchrun_defaults_fix_restarts_and_keep_user_values(tmp_path: object) -> None:
    ns, hosts_store = prepare_torchrun(["--nproc-per-node", "2", "train.py", "--lr", "1"],
                                       settings(), "/tmp/logs")
    assert ns.rdzv_backend == "c10d" and ns.rdzv_endpoint.startswith("127.0.0.1:")
    assert ns.max_restarts == 1000 and hosts_store
    conf = dict(kv.split("=") for kv in ns.rdzv_conf.split(","))
    assert conf["last_call_timeout"] == "2" and conf["is_host"] == "true"
    assert ns.tee == "2" and ns.log_dir == "/tmp/logs"
    assert ns.training_script == "train.py" and ns.training_script_args == ["--lr", "1"]
    ns, _ = prepare_torchrun(["--max-restarts", "3", "--rdzv-backend", "c10d",
                              "--rdzv-endpoint", "10.1.2.3:29400", "--nnodes", "1:2",
                              "--rdzv-conf", "last_call_timeout=9", "x.py"], settings(), "/l")
    conf = dict(kv.split("=") for kv in ns.rdzv_conf.split(","))
    assert ns.max_restarts == 3 and conf["last_call_timeout"] == "9" and "is_host" not in conf


def test_worker_environment_lets_guard_take_no_arguments() -> None:
    url = "nats://10.9.8.7:4333"
    env = worker_environment(settings(allow_drills=True, prefix="p", nats_url=url), "/logs")
    assert env["TRAINGUARD_JOB"] == "j" and env["TRAINGUARD_HOST"] == "node-a"
    assert env["TRAINGUARD_ALLOW_DRILLS"] == "1" and env["TRAINGUARD_PREFIX"] == "p"
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert env["TORCH_FR_DUMP_TEMP_FILE"].startswith("/logs/")
    with pytest.MonkeyPatch.context() as mp:  # the ranks' environment: Guard() reads it
        for k, v in env.items():
            mp.setenv(k, v)
        guard = Guard(rank=0, world_size=1)
    assert (guard.job, guard.host, guard.allow_drills, guard.subjects.prefix) == (
        "j", "node-a", True, "p")
    assert guard.nats_url == url
    # The names the agent sets are the ones its own settings are read from.
    again = load_settings(AgentSettings, env={k: env[k] for k in env if k.startswith("TRAIN")})
    assert (again.job, again.host, again.allow_drills, again.prefix) == ("j", "node-a", True, "p")


def test_ranks_get_the_rank_role_and_nothing_of_the_agents_access(tmp_path: Path) -> None:
    creds = generate(("agent", "rank"))
    paths = write_credentials(tmp_path, creds)
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    agent = settings(credentials=str(paths["agent"]), rank_credentials=str(paths["rank"]),
                     nats_tls_ca=str(ca), nats_tls_key=str(ca), redis_tls_cert=str(ca))
    env = worker_environment(agent, "/logs")
    assert env[envnames.CREDENTIALS] == str(paths["rank"])
    assert env[envnames.NATS_TLS_CA] == str(ca)
    assert env[setting("nats_tls_key")] == env[setting("redis_tls_cert")] == ""
    assert env[setting("rank_credentials")] == ""
    assert not set(envnames.job_settings(env)) & envnames.ACCESS  # never in a hello
    bare = worker_environment(settings(credentials=str(paths["agent"])), "/logs")
    assert bare[envnames.CREDENTIALS] == ""  # not the agent's own


def test_exits_name_the_root_and_the_collateral() -> None:
    sent: list[WorkerExit] = []
    node = LocalNode(settings(), hosts_store=False, gpu=None, publish_exit=sent.append)
    node.workers_started([Worker(0, 0, 100, None), Worker(1, 1, 101, None),
                          Worker(2, 2, 102, None)], 0)
    node.workers_exited({1: Failure(1, 1, 101, 1, "RuntimeError: boom"),
                         0: Failure(0, 0, 100, -signal.SIGTERM),
                         2: Failure(2, 2, 102, -signal.SIGTERM)}, succeeded=False)
    by_rank = {e.rank: e for e in sent}
    assert by_rank[1].initiated_by is None and by_rank[1].exit_code == 1
    assert by_rank[1].error == "RuntimeError: boom"
    assert by_rank[0].initiated_by == "launcher" and by_rank[0].signal == "SIGTERM"
    sent.clear()
    node.initiated = {100: "cmd-1", 101: "cmd-1"}
    node.workers_exited({0: Failure(0, 0, 100, -signal.SIGTERM),
                         1: Failure(1, 1, 101, -signal.SIGKILL)}, succeeded=False)
    assert {e.initiated_by for e in sent} == {"cmd-1"}


def test_an_exit_names_its_own_flight_recorder_dumps_only(tmp_path: Path) -> None:
    """Rank 1's exit names rank 1's dump, never rank 10's or 11's (same leading digits)."""
    for name in ("1", "1.pipe", "10", "11", "2"):
        (tmp_path / f"{FLIGHT_RECORDER_PREFIX}{name}").write_text("x")
    sent: list[WorkerExit] = []
    node = LocalNode(settings(), hosts_store=False, gpu=None, publish_exit=sent.append,
                     log_dir=str(tmp_path))
    node.workers_started([Worker(1, 1, 101, None), Worker(10, 0, 110, None)], 0)
    node.workers_exited({1: Failure(1, 1, 101, 1, "RuntimeError: boom"),
                         10: Failure(10, 0, 110, 1, "RuntimeError: boom")}, succeeded=False)
    named = {e.rank: e.error.partition("flight recorder: ")[2] for e in sent}
    prefix = tmp_path / FLIGHT_RECORDER_PREFIX
    assert named == {1: f"{prefix}1, {prefix}1.pipe", 10: f"{prefix}10"}


def test_a_hold_marks_the_workers_and_ends_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[WorkerExit] = []
    signals: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: signals.append((pid, sig)))
    node = LocalNode(settings(), hosts_store=True, gpu=None, publish_exit=sent.append)
    node.workers_started([Worker(0, 0, 100, None), Worker(1, 1, 101, None)], 3)
    assert f"exits {EXIT_HELD}" in node.hold("hold-1")
    # torch's agent stops the workers on the SIGTERM; the launcher then exits EXIT_HELD.
    assert signals == [(os.getpid(), signal.SIGTERM)] and node.ended_by == "hold-1"
    node.workers_stopped("hold-1")
    assert sorted((e.rank, e.initiated_by, e.attempt) for e in sent) == [
        (0, "hold-1", 3), (1, "hold-1", 3)]  # meant: the detector sees no crash
    node.isolating = "iso-1"
    assert node.ended_by == "iso-1"  # an isolated host still exits EXIT_ISOLATED


def test_gpu_probe_is_unavailable_here_and_scripted_evidence_is_well_formed() -> None:
    source, why = open_source()
    if source is not None:  # a machine with a GPU: the probe must read it
        assert all(isinstance(s, GpuStats) for s in source.sample())
        source.close()
        pytest.skip("this machine has a GPU")
    assert "NVML" in why or "nvidia-ml-py" in why or "no GPU" in why
    scripted = ScriptedSource(gpus=2)
    scripted.inject_ecc(1, 2)
    scripted.inject_xid(79, 1)
    scripted.inject_throttle(["hw_thermal_slowdown"], 0)
    g0, g1 = scripted.sample()
    assert g1.ecc_uncorrected_volatile == 2 and g1.remapped_rows_pending
    assert g0.throttle_reasons == ["hw_thermal_slowdown"] and g0.temperature_c == 92.0
    (xid,) = scripted.xids()
    assert (xid.gpu, xid.code) == (1, 79) and scripted.xids() == []
    assert throttle_names(0x4 | 0x80) == ["sw_power_cap", "hw_power_brake_slowdown"]


def test_a_preflight_command_runs_only_the_checks_that_can_run_beside_training() -> None:
    node = FakeNode()
    ex = CommandExecutor(node)
    out = ex.handle(cmd("p1", "preflight", params={"checks": "nvml, ib"}))
    assert out is not None and out.outcome == "done"
    out = ex.handle(cmd("p2", "preflight", params={"checks": ["nvml", "allreduce"]}))
    assert out is not None and out.outcome == "refused"
    assert "['allreduce'] cannot run beside training" in out.detail
    assert ex.handle(cmd("p3", "preflight")).outcome == "done"  # type: ignore[union-attr]
    assert node.calls == ["preflight:['nvml', 'ib']", "preflight:None"]


RANK_STARTING = """
import faulthandler, signal, sys, time
sys.stdin.readline()  # still starting: no handler for SIGUSR1 yet
faulthandler.register(signal.SIGUSR1, all_threads=True)
print("ready", flush=True)
time.sleep(120)
"""


def test_a_dump_signals_only_ranks_whose_handler_is_installed(tmp_path: Path) -> None:
    """SIGUSR1's default action ends a process: a rank still starting is not signalled
    (it lives on, and the answer says why it has no stack), one with its handler is."""
    err = tmp_path / "rank0.err"
    with open(err, "wb") as fh, subprocess.Popen(
            [sys.executable, "-c", RANK_STARTING], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=fh) as proc:
        try:
            node = LocalNode(settings(), hosts_store=False, gpu=None,
                             publish_exit=lambda e: None)
            node.workers_started([Worker(0, 0, proc.pid, str(err))], 0)
            answer = node.dump([0], timeout=1.0)
            assert "handler is not installed yet" in answer
            assert proc.poll() is None  # alive: the dump did not kill it
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
            assert proc.stdout.readline() == b"ready\n"
            answer = node.dump([0], timeout=10.0)
            assert "most recent call first" in answer and "not installed" not in answer
            assert proc.poll() is None
        finally:
            proc.kill()
