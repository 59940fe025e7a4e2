"""A whole trainguard deployment on this machine: control plane, two agents, one job.

``trainguard up`` (embedded NATS and Redis, every service) and two ``trainguard launch``
agents (``node-a`` hosts the rendezvous store, ``node-b`` does not; 2 ranks each,
``--nnodes 1:2`` so isolating node-b is a real elastic shrink) run as subprocesses on
loopback. :class:`Observer` follows everything they publish.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats

from trainguard.contract import envnames
from trainguard.contract.codec import decode_any_durable, decode_telemetry
from trainguard.contract.envelope import normalize_headers
from trainguard.contract.envnames import setting
from trainguard.contract.schemas import (
    Action,
    Anomaly,
    CheckpointCommitted,
    Diagnosis,
    Fingerprint,
    Heartbeat,
    Incident,
    NodeHello,
    RankHello,
    StepReport,
)
from trainguard.contract.subjects import Subjects
from trainguard.core.auth import Access, load_credentials
from trainguard.core.connection import flush
from trainguard.runtime.embedded import free_port

HOSTS = ("node-a", "node-b")
DEMO_POLICY = """\
[defaults]
restart_budget_per_hour = 30
cooldown_s = 20
ack_timeout_s = 30
resolve_timeout_s = 240
"""


@dataclass
class RankView:
    step: int | None = None
    phase: str | None = None
    step_time: float | None = None
    attempt: int = 0
    last_seen: float = 0.0
    world_size: int = 0
    host: str = ""


@dataclass
class Observer:
    """Everything the job and the services publish, decoded, in arrival order."""

    ranks: dict[int, RankView] = field(default_factory=dict)
    anomalies: list[Anomaly] = field(default_factory=list)
    diagnoses: list[Diagnosis] = field(default_factory=list)
    incidents: dict[str, Incident] = field(default_factory=dict)
    actions: list[Action] = field(default_factory=list)
    checkpoints: list[CheckpointCommitted] = field(default_factory=list)
    fingerprints: dict[int, dict[int, int]] = field(default_factory=dict)
    node_hellos: dict[str, NodeHello] = field(default_factory=dict)
    world_sizes: list[tuple[float, int]] = field(default_factory=list)
    steps_done: dict[int, float] = field(default_factory=dict)
    """Highest step -> when it was first completed by any rank (for goodput)."""
    timeline: list[tuple[float, str]] = field(default_factory=list)

    def on_telemetry(self, msg: Any) -> None:
        now = time.time()
        if isinstance(msg, Heartbeat):
            r = self.ranks.setdefault(msg.rank, RankView())
            r.phase, r.last_seen, r.host = msg.phase, now, msg.host
            if msg.attempt != r.attempt:
                r.attempt = msg.attempt
        elif isinstance(msg, StepReport):
            r = self.ranks.setdefault(msg.rank, RankView())
            r.step, r.step_time, r.last_seen, r.attempt = msg.step, msg.duration, now, msg.attempt
            self.steps_done.setdefault(msg.step, now)
        elif isinstance(msg, Fingerprint):
            self.fingerprints.setdefault(msg.step, {})[msg.rank] = msg.checksum

    def on_durable(self, msg: Any) -> None:
        now = time.time()
        if isinstance(msg, Anomaly):
            self.anomalies.append(msg)
            if msg.status == "open" and msg.rev == 1:
                self.timeline.append((now, f"anomaly   {msg.kind} ranks {msg.ranks} "
                                           f"{','.join(msg.hosts)}"))
        elif isinstance(msg, Diagnosis):
            self.diagnoses.append(msg)
            self.timeline.append((now, f"diagnosis {msg.cause} ({msg.confidence:.2f}) "
                                       f"{msg.status}: {msg.summary[:90]}"))
        elif isinstance(msg, Incident):
            before = self.incidents.get(msg.id)
            self.incidents[msg.id] = msg
            if before is None or before.status != msg.status:
                self.timeline.append((now, f"incident  {msg.id[-6:]} {msg.cause} -> "
                                           f"{msg.status}"))
        elif isinstance(msg, Action):
            self.actions.append(msg)
            self.timeline.append((now, f"action    {msg.action} {msg.status} "
                                       f"{msg.detail[:80]}"))
        elif isinstance(msg, CheckpointCommitted):
            self.checkpoints.append(msg)
            if msg.status != "committed":
                self.timeline.append((now, f"checkpoint {msg.step} {msg.status} {msg.reason}"))
        elif isinstance(msg, NodeHello):
            self.node_hellos[msg.host] = msg
        elif isinstance(msg, RankHello) and (not self.world_sizes
                                             or self.world_sizes[-1][1] != msg.world_size):
            self.world_sizes.append((now, msg.world_size))

    @property
    def max_step(self) -> int:
        steps = [r.step for r in self.ranks.values() if r.step is not None]
        return max(steps) if steps else -1

    def live_ranks(self, within: float = 5.0) -> list[int]:
        now = time.time()
        return sorted(r for r, v in self.ranks.items() if now - v.last_seen < within)


class Cluster:
    """Starts and stops the control plane and the two agents; owns their processes."""

    def __init__(self, workdir: Path, job: str, *, steps: int, step_time: float,
                 ckpt_every: int, model: str = "lm", quiet: bool = True,
                 plane_env: dict[str, str] | None = None,
                 hosts: tuple[str, ...] = HOSTS, nproc: int = 2, in_place: bool = False,
                 trainer: list[str] | None = None) -> None:
        self.workdir = workdir
        self.trainer_argv = trainer
        """What the agents run after ``-m --`` instead of the toy trainer: a module taking
        ``--job --root --steps --step-time --ckpt-every`` (the framework examples)."""
        self.in_place = in_place
        """The trainer recovers in place (``--in-place``: a lost rank is replaced while the
        others keep their processes, a rollback reloads in-process); else every recovery
        restarts the group."""
        self.hosts = hosts
        """The agents, started in this order (the first gets the lowest ranks and serves
        the rendezvous store); ``nproc`` ranks each."""
        self.nproc = nproc
        self.job = job
        self.steps = steps
        self.step_time = step_time
        self.ckpt_every = ckpt_every
        self.model = model
        self.quiet = quiet
        self.nats_port, self.redis_port, self.rdzv_port = free_port(), free_port(), free_port()
        self.prefix = "tg"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.observer = Observer()
        self._nc: Any = None
        self.plane_env = dict(plane_env or {})
        """Extra environment of ``trainguard up`` (the bridge's sinks, say)."""

    @property
    def spans_path(self) -> Path:
        """Every process appends its spans here (JSON lines): one file, whole traces."""
        return self.workdir / "spans.jsonl"

    @property
    def nats_url(self) -> str:
        return f"nats://127.0.0.1:{self.nats_port}"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(envnames.PREFIX)}
        env.update({envnames.NATS_URL: self.nats_url, envnames.REDIS_URL: self.redis_url,
                    envnames.SUBJECT_PREFIX: self.prefix, "GLOO_SOCKET_IFNAME": "lo",
                    "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    setting("policy"): str(self.workdir / "policy.toml"),
                    envnames.CHECKPOINT_ROOT: str(self.workdir / "ckpt"),
                    # The demo packs 4 ranks, 2 agents and the control plane onto a couple of
                    # cores: its throughput wobbles more than a real job's.
                    setting("throughput_drop"): "0.6",
                    setting("otel_exporter"): f"file:{self.spans_path}"})
        return env

    @property
    def creds_dir(self) -> Path:
        """Where ``trainguard up`` keeps each role's credentials (auth is on)."""
        return self.workdir / "plane" / "creds"

    def agent_env(self) -> dict[str, str]:
        """An agent connects as the agent role and hands its ranks the rank role."""
        return {setting("credentials"): str(self.creds_dir / "agent.json"),
                setting("rank_credentials"): str(self.creds_dir / "rank.json")}

    def _spawn(self, name: str, argv: list[str], extra: dict[str, str] | None = None) -> None:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the process
        self.procs[name] = subprocess.Popen(argv, env={**self.env(), **(extra or {})},
                                            stdout=log,
                                            stderr=subprocess.STDOUT, cwd=self.workdir,
                                            start_new_session=True)
        log.close()

    async def start(self, timeout: float = 120.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "policy.toml").write_text(DEMO_POLICY)
        (self.workdir / "ckpt").mkdir(exist_ok=True)
        self._spawn("control-plane", [sys.executable, "-m", "trainguard", "up",
                                      "--nats-port", str(self.nats_port),
                                      "--redis-port", str(self.redis_port),
                                      "--data-dir", str(self.workdir / "plane"),
                                      # free health ports: a demo beside a running `up`
                                      "--base-port", "0"], self.plane_env)
        await self._wait_log("control-plane", "trainguard up: running", timeout)
        # The observer and the drills act as an operator would.
        operator = load_credentials(self.creds_dir / "operator.json")
        self._nc = await nats.connect(self.nats_url, max_reconnect_attempts=-1,
                                      **Access(credentials=operator).nats_options())
        await self._subscribe()
        for host in self.hosts:
            self.start_agent(host)
            await self._until(lambda h=host: h in self.observer.node_hellos, timeout,
                              f"agent {host} to register")
        world = len(self.hosts) * self.nproc
        await self._until(lambda: len(self.observer.live_ranks()) == world
                          and self.observer.max_step >= 3, timeout, f"{world} ranks training")

    def start_agent(self, host: str) -> None:
        """Start ``host``'s agent (again, for a host that comes back); its log goes on in
        ``<host>.log``."""
        self._spawn(host, self.launch_argv(host), self.agent_env())

    def launch_argv(self, host: str) -> list[str]:
        agent = [sys.executable, "-m", "trainguard", "launch", "--job", self.job, "--host", host,
                 "--allow-drills", "--nnodes", f"1:{len(self.hosts)}",
                 "--nproc-per-node", str(self.nproc),
                 "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.rdzv_port}",
                 "--rdzv-id", self.job, "--local-addr", "127.0.0.1", "-m", "--"]
        if self.trainer_argv is not None:
            return [*agent, *self.trainer_argv, "--job", self.job,
                    "--root", str(self.workdir / "ckpt"), "--steps", str(self.steps),
                    "--step-time", str(self.step_time), "--ckpt-every", str(self.ckpt_every)]
        return [*agent,
                "trainguard.examples.toy_trainer", "--job", self.job, "--model", self.model,
                "--steps", str(self.steps), "--step-time", str(self.step_time),
                "--ckpt-root", str(self.workdir / "ckpt"), "--ckpt-every", str(self.ckpt_every),
                "--fingerprint-every", "5", "--heartbeat", "0.5",
                *(["--in-place"] if self.in_place else [])]

    async def _subscribe(self) -> None:
        s = Subjects(self.prefix)
        obs = self.observer

        async def tel(msg: Any) -> None:
            with contextlib.suppress(Exception):
                obs.on_telemetry(decode_telemetry(msg.data))

        async def durable(msg: Any) -> None:
            with contextlib.suppress(Exception):
                h = normalize_headers(msg.headers)
                obs.on_durable(decode_any_durable(msg.data, h.get("ce-type")))

        for kind in ("hb", "step", "fp"):
            await self._nc.subscribe(s.pattern(kind, job=self.job), cb=tel)
        await self._nc.subscribe(s.pattern("event", job=self.job, tail=">"), cb=durable)
        await self._nc.subscribe(s.pattern("reg", job=self.job), cb=durable)
        await flush(self._nc)

    async def publish(self, subject: str, data: bytes, headers: dict[str, str]) -> None:
        await self._nc.jetstream().publish(subject, data, headers=headers)

    @property
    def nc(self) -> Any:
        return self._nc

    async def _wait_log(self, name: str, text: str, timeout: float) -> None:
        path = self.workdir / f"{name}.log"

        def seen() -> bool:
            proc = self.procs[name]
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n"
                                   f"{path.read_text(errors='replace')[-3000:]}")
            return path.exists() and text in path.read_text(errors="replace")

        await self._until(seen, timeout, f"{name}: {text!r}")

    @staticmethod
    async def _until(cond: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
            await asyncio.sleep(0.1)

    async def stop(self) -> None:
        """Agents first (SIGTERM: they save and stop their workers), then the plane."""
        for name in (*self.hosts, "control-plane"):
            if name == "control-plane" and self._nc is not None:
                with contextlib.suppress(Exception):
                    await self._nc.close()  # before its server goes away
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, 45)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await asyncio.to_thread(proc.wait, 10)
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.close()
