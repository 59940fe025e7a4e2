"""The launcher's rank assignment and generations on torch's real c10d rendezvous (a real
TCPStore on loopback), and the environment contract each rank gets."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest

from trainguard.agent.node import LocalNode
from trainguard.agent.rendezvous import JobRendezvous, RendezvousPlan, Round
from trainguard.agent.settings import AgentSettings
from trainguard.agent.spares import SparePool
from trainguard.agent.supervisor import Program, Supervisor, error_message
from trainguard.contract import envnames
from trainguard.recovery import groupstore
from trainguard.runtime.config import load_settings
from trainguard.runtime.embedded import free_port

CONF = {"last_call_timeout": "1", "join_timeout": "60", "keep_alive_interval": "1",
        "keep_alive_max_attempt": "3"}


def plan(endpoint: str, nodes: int, *, host: bool) -> RendezvousPlan:
    return RendezvousPlan(backend="c10d", endpoint=endpoint, run_id="job-1", min_nodes=nodes,
                          max_nodes=nodes, local_addr="127.0.0.1",
                          configs={**CONF, "is_host": "true" if host else "false"})


def test_one_node_gets_every_rank_and_each_restart_a_new_generation() -> None:
    rdzv = JobRendezvous(plan(f"127.0.0.1:{free_port()}", 1, host=True))
    try:
        rnd = rdzv.next_round(3)
        assert (rnd.group_rank, rnd.group_world_size, rnd.base_rank, rnd.world_size) == \
            (0, 1, 0, 3)
        assert rnd.master_port > 0 and rnd.master_addr
        first = rnd.generation
        assert rdzv.bump_generation() == first + 1  # a single-rank restart
        assert rdzv.generation() == first + 1
    finally:
        rdzv.close()


def test_two_nodes_split_the_ranks_and_share_the_generation() -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    host = JobRendezvous(plan(endpoint, 2, host=True))
    other = JobRendezvous(plan(endpoint, 2, host=False))
    rounds: dict[str, Round] = {}
    threads = [threading.Thread(target=lambda n=n, r=r, k=k: rounds.__setitem__(n, r.next_round(k)))
               for n, r, k in (("a", host, 2), ("b", other, 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert set(rounds) == {"a", "b"}
        a, b = rounds["a"], rounds["b"]
        assert a.world_size == b.world_size == 5
        lower, upper = sorted((a, b), key=lambda r: r.group_rank)
        sizes = {id(a): 2, id(b): 3}
        assert lower.base_rank == 0 and upper.base_rank == sizes[id(lower)]
        assert a.generation == b.generation
        assert (a.master_addr, a.master_port) == (b.master_addr, b.master_port)
        bumped = other.bump_generation()
        assert host.generation() == bumped == a.generation + 1  # job-wide
    finally:
        other.close()
        host.close()


def test_a_rank_gets_torchruns_environment_and_its_generation(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as launch() sets it
    settings = load_settings(AgentSettings, env={}, overrides={"job": "j", "host": "node-a"})
    node = LocalNode(settings, hosts_store=True, gpu=None, publish_exit=lambda e: None)
    rdzv = JobRendezvous(plan(f"127.0.0.1:{free_port()}", 1, host=True))
    try:
        rnd = rdzv.next_round(2)
        sup = Supervisor(node=node, rdzv=rdzv, program=Program("train.py", ["--lr", "1"]),
                         nproc=2, max_restarts=7, log_dir=str(tmp_path),
                         spares=SparePool(0, {}, str(tmp_path)), stop_grace=1.0)
        env = sup.rank_env(rnd, 1, 1, 9, 2, "/x/error.json")
        joining = sup.rank_env(rnd, 1, 1, 9, 2, "/x/error.json", join=True)
        # One credential file per rank: each rank's environment names its own only.
        monkeypatch.setenv(envnames.CREDENTIALS, "/run/tg/rank-j-{rank}.creds")
        own = sup.rank_env(rnd, 1, 1, 9, 2, "/x/error.json")
        sup.tail.close()
    finally:
        rdzv.close()
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT",
                                "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
                                "TORCHELASTIC_USE_AGENT_STORE", envnames.GENERATION)} == {
        "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "0", "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "7",
        "TORCHELASTIC_RUN_ID": "job-1", "TORCHELASTIC_USE_AGENT_STORE": "True",
        envnames.GENERATION: "9"}
    assert env["MASTER_PORT"] == str(rnd.master_port)
    assert envnames.JOIN not in env and joining[envnames.JOIN] == "peers"
    assert own[envnames.CREDENTIALS] == "/run/tg/rank-j-1.creds"
    assert envnames.GENERATION not in envnames.job_settings(env)  # not a detector threshold


def test_programs_and_error_files(tmp_path: Path) -> None:
    mod = Program("pkg.train", ["-x"], module=True)
    assert mod.argv() == [sys.executable, "-u", "-m", "pkg.train", "-x"] and mod.warmable
    bare = Program("./run.sh", [], no_python=True)
    assert bare.argv() == ["./run.sh"] and not bare.warmable
    other = Program("t.py", [], python="/opt/py/bin/python")
    assert other.argv()[0] == "/opt/py/bin/python" and not other.warmable
    err = tmp_path / "error.json"
    err.write_text(json.dumps({"message": {"message": "RuntimeError: boom", "extraInfo": {}}}))
    assert error_message(str(err)) == "RuntimeError: boom"
    assert error_message(str(tmp_path / "missing.json")) == ""


def test_a_leaving_node_resizes_the_next_generation_and_the_other_adopts_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """node-b (ranks 2-3) leaves in place: the record of the next generation is written
    before the generation rises, so node-a's supervisor, following the generation, starts
    a later replacement at world size 2 and counts one node at the exit barrier."""
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    endpoint = f"127.0.0.1:{free_port()}"
    a, b = JobRendezvous(plan(endpoint, 2, host=True)), JobRendezvous(plan(endpoint, 2,
                                                                          host=False))
    rounds: dict[str, Round] = {}
    threads = [threading.Thread(target=lambda n=n, r=r: rounds.__setitem__(n, r.next_round(2)))
               for n, r in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    settings = load_settings(AgentSettings, env={}, overrides={"job": "j", "host": "node-a"})
    node = LocalNode(settings, hosts_store=True, gpu=None, publish_exit=lambda e: None)
    sup = Supervisor(node=node, rdzv=a, program=Program("train.py", []), nproc=2,
                     max_restarts=3, log_dir=str(tmp_path),
                     spares=SparePool(0, {}, str(tmp_path)), stop_grace=1.0)
    try:
        lower, upper = sorted(rounds.values(), key=lambda r: r.group_rank)
        leaving = a if upper is rounds["a"] else b
        staying = b if leaving is a else a
        sup.rdzv, sup.round = staying, lower
        node.generation = lower.generation
        resize = groupstore.plan_shrink(4, 2, [2, 3], min_nodes=1, serves_store=False,
                                        reason="host node-b left the job (isolated)")
        assert isinstance(resize, groupstore.Resize)
        assert leaving.mark_leaving("host node-b left the job (isolated)", resize)
        generation = staying.generation()
        assert generation == lower.generation + 1
        assert staying.resizes(lower.generation, generation) == [(generation, resize)]
        sup._follow(generation)
        assert (sup.round.world_size, sup.round.group_world_size) == (2, 1)
        assert node.generation == generation
        env = sup.rank_env(sup.round, 1, 1, generation, 0, "/x/error.json", join=True)
        assert env["WORLD_SIZE"] == "2"
        # Without a resize (a hold, or the job cannot go on): the left key, no new generation.
        assert not leaving.mark_leaving("host node-b left the job (held)")
        assert staying.generation() == generation
        assert staying.resizes(generation, generation + 5) == []
    finally:
        sup.tail.close()
        b.close()
        a.close()


def test_the_ranks_after_a_leaving_host_close_up_the_gap(tmp_path: Path) -> None:
    """node-c (global ranks 4-5 of 6) adopts node-b's leaving: its ranks become 2-3, for
    its node record (heartbeats, exits) and for a later in-place replacement's RANK."""
    from typing import Any, cast

    from trainguard.agent.node import Worker
    from trainguard.agent.supervisor import RankProc

    settings = load_settings(AgentSettings, env={}, overrides={"job": "j", "host": "node-c"})
    node = LocalNode(settings, hosts_store=False, gpu=None, publish_exit=lambda e: None)
    rdzv = JobRendezvous(plan(f"127.0.0.1:{free_port()}", 1, host=True))
    told: list[dict[int, int]] = []
    sup = Supervisor(node=node, rdzv=rdzv, program=Program("train.py", []), nproc=2,
                     max_restarts=3, log_dir=str(tmp_path),
                     spares=SparePool(0, {}, str(tmp_path)), stop_grace=1.0,
                     renumbered=told.append)
    try:
        sup.round = Round(group_rank=2, group_world_size=3, base_rank=4, world_size=6,
                          master_addr="127.0.0.1", master_port=1, generation=3, store=None)
        popen = cast(Any, None)
        sup.group = {lr: RankProc(lr, 4 + lr, popen, "o", "e", "f", warm=False)
                     for lr in (0, 1)}
        node.workers_started([Worker(rank=4 + lr, local_rank=lr, pid=500 + lr, stderr=None)
                              for lr in (0, 1)], 0)
        resize = groupstore.plan_shrink(6, 3, [2, 3], min_nodes=1, serves_store=False,
                                        reason="host node-b left the job (isolated)")
        assert isinstance(resize, groupstore.Resize)
        sup._adopt(4, resize)
        assert [p.rank for p in sup.group.values()] == [2, 3]
        assert (sup.round.world_size, sup.round.group_world_size, sup.round.base_rank) == (
            4, 2, 2)
        assert node.rank_pids() == {2: 500, 3: 501}
        assert told == [{4: 2, 5: 3}]  # jwt mode: their files get the new numbers'
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TRAINGUARD_CREDENTIALS", "/c/local-{local_rank}.creds")
            env = sup.rank_env(sup.round, 1, sup.group[1].rank, 4, 0, "/x/error.json",
                               join=True)
        assert (env["RANK"], env["WORLD_SIZE"]) == ("3", "4")
        assert env["TRAINGUARD_CREDENTIALS"] == "/c/local-1.creds"  # the process's file
    finally:
        sup.tail.close()
        rdzv.close()


def test_the_signal_that_ends_a_launcher_is_not_taken_for_an_error() -> None:
    """The launcher's signal handler raises ``Stopping`` wherever the main thread is, often
    inside a rendezvous store call that takes a failing store in its stride (``except
    Exception``). Caught there, an isolation was lost: the agent went on, restarted its
    ranks and took its host back into the job."""
    import signal

    from trainguard.agent.launcher import Stopping

    def on_signal(signum: int, frame: object) -> None:
        raise Stopping(signum)

    def store_call() -> str:
        try:
            signal.raise_signal(signal.SIGUSR2)  # arrives during the call
        except Exception:
            return "the store did not answer"
        return "answered"

    previous = signal.signal(signal.SIGUSR2, on_signal)
    try:
        with pytest.raises(Stopping):
            store_call()
    finally:
        signal.signal(signal.SIGUSR2, previous)
