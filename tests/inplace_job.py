"""A gloo job of toy-trainer ranks on loopback with the test playing the agent.

The test holds the job's rendezvous ``TCPStore`` (the agent's store), starts the ranks with
the environment ``trainguard launch`` gives them, and replaces a rank the way the agent
does: bump :data:`trainguard.recovery.groupstore.GENERATION`, start the same rank with
``TRAINGUARD_JOIN=peers`` and the new ``TRAINGUARD_GENERATION``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch.distributed import PrefixStore, TCPStore

from trainguard.contract import envnames
from trainguard.recovery import groupstore
from trainguard.runtime.embedded import free_port

RUN_ID = "inplace-test"


class Job:
    """``world`` toy-trainer ranks sharing one job store, logs and a progress file."""

    def __init__(self, tmp: Path, world: int, args: list[str], *,
                 env: dict[str, str] | None = None) -> None:
        self.tmp = tmp
        self.world = world
        self.args = args
        self.port = free_port()
        self.store = TCPStore("127.0.0.1", self.port, is_master=True,
                              timeout=timedelta(seconds=60), wait_for_workers=False)
        self.job_store = PrefixStore(groupstore.job_prefix(RUN_ID), self.store)
        self.generation = int(self.job_store.add(groupstore.GENERATION, 1))
        self.progress = tmp / "progress.log"
        self.final = tmp / "final.pt"
        self.extra_env = env or {}
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.replaced: list[subprocess.Popen[bytes]] = []

    def env(self, rank: int, *, join: bool = False) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            envnames.RANK: str(rank), envnames.WORLD_SIZE: str(self.world),
            envnames.LOCAL_RANK: str(rank), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self.port), "TORCHELASTIC_RUN_ID": RUN_ID,
            "TORCHELASTIC_USE_AGENT_STORE": "True", envnames.RESTART_COUNT: "0",
            envnames.GENERATION: str(self.generation), "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **self.extra_env,
        })
        env.setdefault(envnames.DISABLED, "1")
        if join:
            env[envnames.JOIN] = envnames.JOIN_PEERS
        return env

    def spawn(self, rank: int, *, join: bool = False) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"rank{rank}{'-join' if join else ''}.log", "ab")  # noqa: SIM115
        cmd = [sys.executable, "-m", "trainguard.examples.toy_trainer",
               "--progress-file", str(self.progress), "--final-params", str(self.final),
               *self.args]
        proc = subprocess.Popen(cmd, env=self.env(rank, join=join), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        self.procs[rank] = proc
        return proc

    def start(self) -> Job:
        for rank in range(self.world):
            self.spawn(rank)
        return self

    def steps_done(self) -> list[int]:
        """Rank 0's completed steps, in order (its progress lines)."""
        if not self.progress.exists():
            return []
        return [int(line.split()[1]) for line in self.progress.read_text().splitlines()
                if "fault=" not in line]

    def pids(self) -> list[int]:
        """The pid on each of rank 0's progress lines."""
        return [int(line.split()[3]) for line in self.progress.read_text().splitlines()
                if "fault=" not in line]

    def wait_for_step(self, step: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(s >= step for s in self.steps_done()):
            if time.monotonic() > deadline:
                raise AssertionError(f"rank 0 did not reach step {step}:\n{self.logs()}")
            if any(p.poll() is not None for p in self.procs.values()):
                raise AssertionError(f"a rank exited before step {step}:\n{self.logs()}")
            time.sleep(0.02)

    def ready_in_place(self, generation: int | None = None) -> bool:
        """Every rank set its in-place key in ``generation`` (default: the current one)."""
        g = self.generation if generation is None else generation
        keys = [groupstore.in_place_key(g, r) for r in range(self.world)]
        return self.job_store.check(keys)

    def kill(self, rank: int) -> int:
        proc = self.procs[rank]
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        self.replaced.append(proc)
        return proc.pid

    def replace(self, rank: int) -> subprocess.Popen[bytes]:
        """What the agent does for a lost rank: a new generation, the rank joins it."""
        self.generation = int(self.job_store.add(groupstore.GENERATION, 1))
        return self.spawn(rank, join=True)

    def shrink(self, rank: int, reason: str) -> None:
        """What the agent of a host that leaves in place does (``Supervisor.leaving``):
        the next generation's resize record, then the generation, then its rank stops."""
        resize = groupstore.plan_shrink(self.world, 2, [rank], min_nodes=1,
                                        serves_store=False, reason=reason)
        assert isinstance(resize, groupstore.Resize), resize
        self.job_store.set(groupstore.resize_key(self.generation + 1), resize.encode())
        self.generation = int(self.job_store.add(groupstore.GENERATION, 1))
        self.kill(rank)
        del self.procs[rank]
        self.world = resize.world_size

    def wait(self, timeout: float = 180.0) -> dict[int, int]:
        deadline = time.monotonic() + timeout
        codes = {}
        for rank, proc in self.procs.items():
            try:
                codes[rank] = proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"rank {rank} did not finish:\n{self.logs()}") from None
        return codes

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}"
                         for p in sorted(self.tmp.glob("rank*.log")))

    def final_params(self) -> dict[str, Any]:
        state: dict[str, Any] = torch.load(self.final, weights_only=True)
        return state

    def stop(self) -> None:
        for proc in [*self.procs.values(), *self.replaced]:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def same_params(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Names whose tensors differ (bit for bit) between two state dicts."""
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]
