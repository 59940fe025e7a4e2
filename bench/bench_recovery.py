"""Recovery: one job, four faults, under torchrun, NVRx and trainguard, in one run.

The job is the demo's: ``trainguard.examples.toy_trainer`` (a small character-level
transformer LM, gloo on CPU), 4 ranks on two agents ``node-a`` / ``node-b`` with 2 ranks
each, a checkpoint every 10 steps. ``--parallel`` picks how it is spread over the ranks,
the same for every setup: ``dp`` (default) replicates it and all-reduces the gradients,
``fsdp`` shards it with FSDP2 (``fully_shard`` per transformer block and on the root, a
1-D mesh over the 4 ranks), ``hsdp`` with HSDP (a 2x2 ``(replicate, shard)`` mesh);
``--optimizer`` (SGD for ``dp``, AdamW and its sharded state for the sharded modes unless
given) goes to the trainer as it is. The faults strike rank 1 (rank 0 for NaN): a crash (an
exception), a hang (blocked in the data phase; ``hang-compute``: in compute), SIGSTOP, and
NaN written into the parameters (a straggler, compute 2x slower, on request). Each runs
under

- torchrun ``--max-restarts 3``, c10d rendezvous with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
  (stock restarts fail on gloo with "Gloo connectFullMesh failed", pytorch/pytorch#135712)
  and a 10 s process-group timeout;
- NVRx 0.4.1's ``ft_launcher`` (nvidia-resiliency-ext, installed with ``--no-deps`` into
  the bench-only, git-ignored ``.bench-venv`` with its pure-Python requirements) with
  ``--ft-rank-heartbeat-timeout 5``, the same rendezvous and timeout, the trainer sending a
  ``RankMonitorClient`` heartbeat after every step (``--ft-heartbeat``);
- trainguard: ``trainguard up`` and two ``trainguard launch`` agents
  (:class:`trainguard.demo.cluster.Cluster`), the coordinator's checkpoint interval pinned to
  the baselines' 10 steps (in seconds, from their clean step time), the faults played by
  :class:`trainguard.demo.runner.Runner` one after another on the same job, twice
  (``--trainguard``): the trainer recovering in place (``--in-place``) and without it (the
  group restarts from the committed checkpoint, through warm spares).

The baselines run the same trainer with ``TRAINGUARD_DISABLED=1``, its own fault flags
(``--raise-at``, ``--hang-at``, ``--stop-at``, ``--nan-at``, ``--slow``) and plain
checkpoints (``--plain-ckpt``): ``torch.save`` on rank 0 for ``dp``; for a sharded model DCP,
as a user of FSDP would checkpoint it (every rank saves its shards of model and optimizer to
``step-<S>/``, rank 0 then names the step in ``latest``, and a restart loads from there).
trainguard's trainer saves through ``trainguard.torch.Checkpointer`` (DCP too) whatever the
mode. ``--setups`` adds the stock rendezvous or torch's default 30 min timeout.

Every number comes from rank 0's progress file (``--progress-file``: one line per step with
time and pid), the agents' logs (baselines) or the anomalies on the bus (trainguard):

- detected: fault -> the launcher reports the failed worker (or NVRx the missing
  heartbeat) / trainguard's anomaly. A baseline that never reacts (straggler, NaN) is
  "not detected";
- first step after the fault: fault -> the restarted job's first completed step;
- back where it was: fault -> the restarted job completes a step past the last one before
  the fault (a straggler, too, is over only when its process has been replaced);
- steps lost: steps done before the fault that the restart had to redo (NaN without
  detection: every step since the onset, which trained on NaN);
- goodput: new useful steps in a fixed window after the fault, times the clean step time,
  over the window (1.0: the fault cost nothing).

A run is observed for that window and no longer: what had not happened by then is reported
as "> bound", never extrapolated. Everything binds to 127.0.0.1 on free ports; every
process started here (agents, workers, servers) is tracked by pid and killed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.runtime.embedded import free_port, port_taken

STEP_TIME = 0.05
CKPT_EVERY = 10
FAULT_STEP = 45
FAULT_RANK = 1
NAN_RANK = 0
SLOW_FACTOR = 2.0
MAX_RESTARTS = 3
SHORT_PG_TIMEOUT = 10.0
DEFAULT_PG_TIMEOUT = 1800.0  # torch.distributed.constants.default_pg_timeout (checked below)
NVRX_HEARTBEAT_TIMEOUT = 5.0
STARTUP_BOUND = 300.0
"""Seconds a job may take to reach the fault (4 ranks importing torch on a busy machine)."""
CRASH_MESSAGE = "RuntimeError: injected crash (bench_recovery)"
HOSTS = ("node-a", "node-b")
FAULT_NAMES = ("crash", "hang", "hang-compute", "sigstop", "nan", "straggler")
DEFAULT_FAULTS = ("crash", "hang", "sigstop", "nan")
STOPS = ("crash", "hang", "hang-compute", "sigstop")
"""Faults that stop the job: it is back once a step past the last one before is done."""

# Observation window per fault, seconds after the fault (the same for every setup).
WINDOWS = {"crash": 25.0, "hang": 45.0, "hang-compute": 45.0, "sigstop": 50.0, "nan": 15.0,
           "straggler": 25.0}
QUICK_WINDOWS = {"crash": 20.0, "hang": 35.0, "hang-compute": 35.0, "sigstop": 40.0, "nan": 10.0,
                 "straggler": 15.0}

AGENT_FAILURE = re.compile(r"torch/distributed/elastic/\S+\] (failed \(exitcode|"
                           r"Sending process \d+ closing signal)|"
                           r"\[ft_launcher\d+@\S+\] failed \(exitcode|"
                           r"Did not get subsequent heartbeat")
RESTART_FAILURE = "Gloo connectFullMesh failed"


# -- processes ---------------------------------------------------------------------------------

def _stat(pid: int) -> tuple[int, int] | None:
    """(ppid, start time in clock ticks) of a live process, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read().decode(errors="replace")
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2:].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), int(fields[19])


class Tracker:
    """Every process descended from the roots we started, by (pid, start time), so that the
    end kills exactly those, by pid. torch's elastic agent starts each worker in a new
    session, so process groups do not cover them; a poller follows restarts, and each
    process remembers its root even after its parent is gone."""

    def __init__(self) -> None:
        self.known: dict[int, tuple[int, int]] = {}
        """pid -> (start time in clock ticks, the root it descends from)."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="tracker", daemon=True)
        self._thread.start()

    @property
    def roots(self) -> set[int]:
        with self._lock:
            return {pid for pid, (_, root) in self.known.items() if pid == root}

    def add_root(self, pid: int) -> None:
        st = _stat(pid)
        if st is not None:
            with self._lock:
                self.known.setdefault(pid, (st[1], pid))
        self.scan()

    def scan(self) -> None:
        children: dict[int, list[tuple[int, int]]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                st = _stat(int(entry))
                if st is not None:
                    children.setdefault(st[0], []).append((int(entry), st[1]))
        with self._lock:
            todo = [p for p in self.known if self._alive(p)]
            while todo:
                pid = todo.pop()
                root = self.known[pid][1]
                for child, start in children.get(pid, []):
                    if child not in self.known or not self._alive(child):
                        self.known[child] = (start, root)
                        todo.append(child)

    def _alive(self, pid: int) -> bool:
        st = _stat(pid)
        return st is not None and pid in self.known and st[1] == self.known[pid][0]

    def _poll(self) -> None:
        while not self._stop.wait(0.25):
            with contextlib.suppress(Exception):
                self.scan()

    def kill(self, roots: set[int] | None = None) -> int:
        """Freeze those roots (no new children), rescan, then SIGKILL every live process
        that descends from them (all tracked ones when None). Returns how many."""
        with self._lock:
            chosen = {p for p, (_, r) in self.known.items() if p == r
                      and (roots is None or p in roots)}
        for pid in chosen:
            if self._alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
        self.scan()
        killed = 0
        with self._lock:
            targets = [p for p, (_, r) in self.known.items() if r in chosen and self._alive(p)]
        for pid in sorted(targets, key=lambda p: p in chosen):  # children first
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
        return killed

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.kill()


class Agent:
    """One torchrun agent, its output timestamped line by line as it arrives."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], cwd: Path,
                 tracker: Tracker) -> None:
        self.name = name
        self.lines: list[tuple[float, str]] = []
        self.log = open(cwd / f"{name}.log", "w")  # noqa: SIM115 - closed by the reader
        self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        tracker.add_root(self.proc.pid)
        self._reader = threading.Thread(target=self._read, name=f"read-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            t = time.time()
            line = raw.decode(errors="replace").rstrip("\n")
            self.lines.append((t, line))
            self.log.write(f"{t:.3f} {line}\n")
        self.log.close()

    def finish(self) -> None:
        self._reader.join(timeout=5)


# -- the NVRx baseline's venv ----------------------------------------------------------------

NVRX = "nvidia-resiliency-ext==0.4.1"
NVRX_DEPS = ("defusedxml", "packaging", "psutil", "pyyaml", "nvidia-ml-py")
"""NVRx's pure-Python requirements (its ``torch`` and ``pynvml`` come from the project's
venv, reached through a ``.pth``); NVRx itself goes in with ``--no-deps``."""
BENCH_VENV = Path(__file__).resolve().parent.parent / ".bench-venv"


def nvrx_python(venv: Path = BENCH_VENV) -> Path:
    """The bench-only venv with NVRx, made on first use (git-ignored): its interpreter sees
    the project's packages (torch, trainguard) through a ``.pth`` that adds this
    interpreter's site directories, so the trainer is the same code in both."""
    py = venv / "bin" / "python"
    ft = venv / "bin" / "ft_launcher"
    if py.exists() and ft.exists():
        return py
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    site_dirs = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], check=True, capture_output=True,
                             text=True).stdout.strip()
    # An `import` line in a .pth runs at start-up: addsitedir also processes the .pth files
    # of those directories (the editable trainguard install, a chained venv).
    (Path(purelib) / "zz_project_venv.pth").write_text(
        "import site; " + "; ".join(f"site.addsitedir({d!r})" for d in site_dirs) + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", NVRX, *NVRX_DEPS],
                   check=True)
    return py


# -- progress ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rec:
    t: float
    step: int
    attempt: int
    pid: int


@dataclass(frozen=True)
class Mark:
    t: float
    step: int
    kind: str
    rank: int


def read_progress(path: Path) -> tuple[list[Rec], list[Mark]]:
    recs: list[Rec] = []
    marks: list[Mark] = []
    if not path.exists():
        return recs, marks
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        try:
            t, step, attempt, pid = float(parts[0]), int(parts[1]), int(parts[2]), int(parts[3])
        except ValueError:
            continue
        extra = dict(p.split("=", 1) for p in parts[4:] if "=" in p)
        if "fault" in extra:
            marks.append(Mark(t, step, extra["fault"], int(extra.get("rank", -1))))
        else:
            recs.append(Rec(t, step, attempt, pid))
    return recs, marks


@dataclass
class Measure:
    """What one fault did to one setup, from rank 0's progress records."""

    window: float
    clean_step_s: float | None = None
    step_time_after_s: float | None = None
    """Median step time in the window, restarts excluded (a straggler's cost shows here)."""
    step_at_fault: int | None = None
    last_step_before_restart: int | None = None
    resume_step: int | None = None
    restarts: int = 0
    first_step_s: float | None = None
    """Fault -> the first step of the restarted job (whatever step it resumed at)."""
    recover_s: float | None = None
    """Fault -> back where it was: a step past the last one completed before the fault."""
    steps_lost: int | None = None
    poisoned_steps: int | None = None
    goodput: float | None = None
    progress_in_window: int | None = None


def measure(recs: list[Rec], t0: float, window: float, fault: str,
            fault_step: int | None = None) -> Measure:
    """``t0``: when the fault struck; ``fault_step``: the step it struck at, when known (the
    baselines' flags fire at the start of a step; rank 0 may still log the one before)."""
    m = Measure(window)
    before = [r for r in recs if r.t <= t0]
    if not before:
        return m
    pid0 = before[-1].pid
    k0 = before[-1].step if fault_step is None else fault_step - 1
    m.step_at_fault = k0
    same = [r for r in before if r.pid == pid0][-40:]
    gaps = [b.t - a.t for a, b in itertools.pairwise(same) if b.step == a.step + 1]
    m.clean_step_s = statistics.median(gaps) if gaps else None
    end = t0 + window
    inside = [r for r in recs if t0 < r.t <= end]
    old = [r for r in recs if r.pid == pid0 and r.t <= end]
    new = [r for r in inside if r.pid != pid0]
    m.restarts = len({r.pid for r in new})
    k_old = max(r.step for r in old)
    m.last_step_before_restart = k_old
    # In place, a rollback reloads in the same process: its step goes back.
    rolled = next((b for a, b in itertools.pairwise([r for r in old if r.t > t0 - 1])
                   if b.t > t0 and b.step <= a.step), None)
    if fault == "nan":
        first_bad = k0 + 1
        bad = [r for r in old if r.step >= first_bad and (rolled is None or r.t < rolled.t)]
        m.poisoned_steps = len(bad)
        target = first_bad - 1
        useful = [r for r in recs if r.t <= end and not (
            r.pid == pid0 and r.step >= first_bad and (rolled is None or r.t < rolled.t))]
    else:
        target = k_old if fault in STOPS else k0
        useful = [r for r in recs if r.t <= end]
    if new:
        m.resume_step = new[0].step
        m.first_step_s = new[0].t - t0
        m.steps_lost = max(0, k_old - new[0].step + 1)
        past = [r for r in new if r.step > target]
        if past:  # a straggler, too, is over only when its process is replaced
            m.recover_s = past[0].t - t0
    elif fault == "nan" and rolled is not None:
        m.resume_step = rolled.step
        m.first_step_s = rolled.t - t0
        m.steps_lost = max(0, max((r.step for r in bad), default=k0) - rolled.step + 1)
        past = [r for r in old if r.t >= rolled.t and r.step > target]
        if past:
            m.recover_s = past[0].t - t0
    elif fault == "nan":
        m.steps_lost = m.poisoned_steps
    elif fault in STOPS:
        # In place: rank 0's process stays. The group stalls on the failed step, abandons it
        # and runs it again: the stall is the run of slow steps that starts within the first
        # few after the fault (a step the failing rank still finished may come first; a
        # short stall may straddle two steps), and the job is back at its end.
        after = [r for r in inside if r.pid == pid0]
        slow = 2 * (m.clean_step_s or STEP_TIME)
        paced = [(b, b.t - a.t) for a, b in itertools.pairwise([before[-1], *after])]
        start = next((i for i, (_, g) in enumerate(paced[:3]) if g > slow), None)
        if start is not None:
            end = start
            while end + 1 < len(paced) and paced[end + 1][1] > slow:
                end += 1
            resumed, back = paced[start][0], paced[end][0]
            m.resume_step = resumed.step
            m.first_step_s = resumed.t - t0
            m.recover_s = back.t - t0
            m.steps_lost = max(0, (paced[start - 1][0].step if start else k0)
                               - resumed.step + 1)
    gaps_after = [b.t - a.t for a, b in itertools.pairwise(inside)
                  if b.pid == a.pid and b.step == a.step + 1]
    m.step_time_after_s = statistics.median(gaps_after) if gaps_after else None
    top = max((r.step for r in useful), default=k0)
    m.progress_in_window = max(0, top - k0)
    if m.clean_step_s:
        m.goodput = min(1.0, m.progress_in_window * m.clean_step_s / window)
    return m


# -- baselines: torchrun -----------------------------------------------------------------------

@dataclass(frozen=True)
class Setup:
    key: str
    label: str
    pg_timeout: float
    stock: bool
    launcher: str = "torchrun"
    """``torchrun`` or ``nvrx`` (NVRx's ``ft_launcher``, the trainer sending heartbeats)."""


SETUPS = {s.key: s for s in (
    Setup("torchrun", "torchrun, c10d + workaround, 10 s PG timeout", SHORT_PG_TIMEOUT, False),
    Setup("nvrx", f"NVRx 0.4.1 ft_launcher, {NVRX_HEARTBEAT_TIMEOUT:.0f} s heartbeat timeout",
          SHORT_PG_TIMEOUT, False, "nvrx"),
    # Older comparisons, on request (--setups): the stock rendezvous cannot restart gloo.
    Setup("torchrun-stock", "torchrun, stock rendezvous, 10 s PG timeout", SHORT_PG_TIMEOUT,
          True),
    Setup("torchrun-default", "torchrun + workaround, default PG timeout (30 min)",
          DEFAULT_PG_TIMEOUT, False),
)}


def fault_flags(fault: str) -> list[str]:
    return {
        "crash": ["--raise-at", f"{FAULT_RANK}:{FAULT_STEP}", "--raise-message", CRASH_MESSAGE],
        "hang": ["--hang-at", f"{FAULT_RANK}:{FAULT_STEP}"],
        "hang-compute": ["--hang-at", f"{FAULT_RANK}:{FAULT_STEP}", "--hang-phase", "compute"],
        "straggler": ["--slow", f"{FAULT_RANK}:{SLOW_FACTOR}", "--slow-from", str(FAULT_STEP)],
        "nan": ["--nan-at", f"{NAN_RANK}:{FAULT_STEP}"],
        "sigstop": ["--stop-at", f"{FAULT_RANK}:{FAULT_STEP}"],
    }[fault]


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    env.update({"TRAINGUARD_DISABLED": "1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1"})
    return env


PARALLEL = ("dp", "fsdp", "hsdp")


@dataclass(frozen=True)
class Spread:
    """How the trainer spreads the model and what optimizes it: the same in every setup."""

    parallel: str = "dp"
    optimizer: str = "sgd"

    @property
    def flags(self) -> list[str]:
        return ["--parallel", self.parallel, "--optimizer", self.optimizer]

    @property
    def suffix(self) -> str:
        """Of a work directory: "" for dp (the names stay as they were), else the mode."""
        return "" if self.parallel == "dp" else f"-{self.parallel}"


def run_baseline(fault: str, setup: Setup, window: float, root: Path,
                 tracker: Tracker, spread: Spread = Spread()) -> dict[str, Any]:
    work = root / f"{fault}-{setup.key}{spread.suffix}"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    progress = work / "progress"
    port = free_port()
    env = base_env()
    if not setup.stock:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    trainer = ["-m", "trainguard.examples.toy_trainer", "--job", "bench", "--model", "lm",
               "--steps", "1000000", "--step-time", str(STEP_TIME),
               "--ckpt-every", str(CKPT_EVERY), "--plain-ckpt", str(work / "ckpt"),
               "--progress-file", str(progress), "--pg-timeout", str(setup.pg_timeout),
               *spread.flags, *fault_flags(fault)]
    agents: list[Agent] = []
    started = time.time()
    result: dict[str, Any] = {"fault": fault, "setup": setup.key, "label": setup.label,
                              "window_s": window, "pg_timeout_s": setup.pg_timeout,
                              "rendezvous": "static (stock)" if setup.stock else
                              "c10d + TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"}
    try:
        for i, host in enumerate(HOSTS):
            if setup.stock:
                rdzv = ["--node-rank", str(i), "--master-addr", "127.0.0.1",
                        "--master-port", str(port)]
            else:
                rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                        "--rdzv-id", "bench"]
            if setup.launcher == "nvrx":
                launcher = [str(nvrx_python().parent / "ft_launcher"),
                            "--ft-rank-heartbeat-timeout", str(NVRX_HEARTBEAT_TIMEOUT),
                            # No NICs or GPUs to watch here (it only logs that it has none).
                            "--ft-enable-nic-monitor", "false"]
                extra = ["--ft-heartbeat"]
            else:
                launcher, extra = [sys.executable, "-m", "torch.distributed.run"], []
            argv = [*launcher, "--nnodes", "2", *rdzv,
                    "--nproc-per-node", "2", "--local-addr", "127.0.0.1",
                    "--max-restarts", str(MAX_RESTARTS), *trainer, *extra]
            agents.append(Agent(host, argv, env, work, tracker))
            if i == 0:  # node-a hosts the store
                _wait(lambda: port_taken(port), 60, "node-a's store to listen",
                      lambda: agents[0].proc.poll() is None)
        mark = _wait_mark(progress, STARTUP_BOUND,
                          lambda: any(a.proc.poll() is None for a in agents))
        t0 = mark.t
        result["startup_s"] = round(t0 - started, 1)
        deadline = t0 + window
        while time.time() < deadline and any(a.proc.poll() is None for a in agents):
            time.sleep(0.2)
        result["agents_exited"] = {a.name: a.proc.poll() for a in agents}
    except Exception as exc:  # reported; the benchmark goes on
        result["error"] = f"{type(exc).__name__}: {exc}"
        return result
    finally:
        tracker.kill({a.proc.pid for a in agents})
        for a in agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                a.proc.wait(timeout=10)
            a.finish()
        result["seconds"] = round(time.time() - started, 1)
    lines = sorted((t, a.name, line) for a in agents for t, line in a.lines)
    failures = [(t, n, ln) for t, n, ln in lines if t0 <= t <= deadline
                and AGENT_FAILURE.search(ln)]
    restart_failures = [(t, n, ln) for t, n, ln in lines if t0 <= t <= deadline
                        and RESTART_FAILURE in ln]
    recs, _ = read_progress(progress)
    m = measure(recs, t0, window, fault, fault_step=mark.step)
    result.update(dataclasses.asdict(m))
    result["detect_s"] = round(failures[0][0] - t0, 2) if failures else None
    result["detected_by"] = failures[0][2][-160:] if failures else None
    result["restart_failed"] = bool(restart_failures)
    if restart_failures:
        result["restart_failure"] = restart_failures[0][2][-200:]
    return result


def _wait(cond: Any, timeout: float, what: str, alive: Any) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if not alive():
            raise RuntimeError(f"exited while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.1)


def _wait_mark(path: Path, timeout: float, alive: Any) -> Mark:
    found: list[Mark] = []

    def seen() -> bool:
        found[:] = read_progress(path)[1]
        return bool(found)

    _wait(seen, timeout, "the fault to fire", alive)
    return found[0]


# -- (c) trainguard ----------------------------------------------------------------------------

def _trainguard_faults() -> dict[str, Any]:
    from trainguard.demo.scenario import FAULTS, Fault

    return {
        # A plain exception, the same text as the baselines' --raise-at.
        "crash": Fault("crash", "crash", rank=FAULT_RANK, params={"message": CRASH_MESSAGE},
                       anomaly="crash", causes=("process_crash",), actions=("restart",)),
        "hang": FAULTS["hang"],
        "hang-compute": dataclasses.replace(
            FAULTS["hang"], params={**FAULTS["hang"].params, "phase": "compute"}),
        "sigstop": FAULTS["sigstop"],
        # No undo on detection: the rank stays slow for the window, as in the baselines.
        "straggler": dataclasses.replace(FAULTS["straggler"], undo=None),
        "nan": FAULTS["nan"],
    }


TRAINGUARD_VARIANTS = {"in-place": "trainguard, in place", "restart": "trainguard, group restart",
                       "in-place-disk": "trainguard, in place, no memory snapshots",
                       "in-place-buddy": "trainguard, in place, buddy copies"}
"""The trainer recovering in place (``--in-place``: survivors stay, a warm spare takes the
lost rank's state from them), the same trainer without it (every rank restarts from the
committed checkpoint, through warm spares), in place without memory snapshots (a
rollback goes to the committed checkpoint: what the memory tier is measured against), and
in place with a memory snapshot every 5 steps copied to a buddy on the other host (a
sharded state with no replica comes back from memory)."""


async def run_trainguard(faults: list[str], windows: dict[str, float], root: Path,
                         tracker: Tracker, variant: str = "in-place",
                         spread: Spread = Spread(),
                         interval_s: float | None = None) -> dict[str, dict[str, Any]]:
    """``interval_s``: pin the coordinator's checkpoint interval to this many seconds (the
    baselines' ``CKPT_EVERY`` steps), so steps lost compare like with like; None: its
    Young/Daly interval, clamped to the production floor of a minute."""
    from trainguard.contract.envnames import setting
    from trainguard.demo.cluster import Cluster
    from trainguard.demo.runner import Outcome, Runner

    class ProgressCluster(Cluster):
        """The demo's cluster, with rank 0 writing the same progress file as the baselines
        and the trainer spread and optimized as theirs (its flags close the command line)."""

        progress_file: Path

        def launch_argv(self, host: str) -> list[str]:
            return [*super().launch_argv(host), "--progress-file", str(self.progress_file),
                    *(["--in-place"] if variant.startswith("in-place") else []),
                    *(["--memory-snapshots", "off"] if variant == "in-place-disk" else []),
                    *(["--buddy", "--memory-snapshots", "5"] if variant == "in-place-buddy"
                      else []),
                    *spread.flags]

        def env(self) -> dict[str, str]:
            env = super().env()
            if interval_s is not None:
                env[setting("interval_min")] = env[setting("interval_max")] = f"{interval_s:.3f}"
            return env

    label = TRAINGUARD_VARIANTS[variant]
    work = root / f"trainguard-{variant}{spread.suffix}"
    if work.exists():
        shutil.rmtree(work)
    cluster = ProgressCluster(work, "bench", steps=1_000_000, step_time=STEP_TIME,
                              ckpt_every=CKPT_EVERY)
    cluster.progress_file = work / "progress"
    results: dict[str, dict[str, Any]] = {}
    started = time.time()
    watching = True

    async def watch_procs() -> None:
        while watching:
            for proc in list(cluster.procs.values()):
                if proc.pid not in tracker.roots:
                    tracker.add_root(proc.pid)
            await asyncio.sleep(0.2)

    watcher = asyncio.create_task(watch_procs())
    try:
        try:
            await cluster.start(timeout=150)
        except Exception as exc:  # the column says why
            reason = f"cluster did not start: {type(exc).__name__}: {str(exc)[:300]}"
            return {f: {"fault": f, "setup": "c", "label": label, "pending": reason}
                    for f in faults}
        startup = time.time() - started
        runner = Runner(cluster)
        obs = cluster.observer
        # The first fault strikes where the baselines' does: a few steps past a checkpoint.
        await _until(lambda: obs.max_step >= FAULT_STEP - 4, 120)
        tg_faults = _trainguard_faults()
        for name in faults:
            fault = tg_faults[name]
            window = windows[name]
            res: dict[str, Any] = {"fault": name, "setup": "c", "label": label,
                                   "window_s": window, "drill": fault.kind,
                                   "startup_s": round(startup, 1)}
            results[name] = res
            seen_timeline = len(obs.timeline)
            task = asyncio.create_task(runner.play(fault))
            t0 = await _injected(obs, seen_timeline, fault.name, task, timeout=150)
            if t0 is None:
                err = task.exception() if task.done() and not task.cancelled() else None
                res["pending"] = f"not played: {type(err).__name__}: {err}" if err else \
                    "not played: training did not become healthy"
                task.cancel()
                continue
            await asyncio.wait({task}, timeout=max(0.0, t0 + window - time.time()))
            outcome: Outcome | None = None
            if task.done() and not task.cancelled() and task.exception() is None:
                outcome = task.result()
            else:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            await asyncio.sleep(max(0.0, t0 + window - time.time()))
            if fault.undo is None and name == "straggler":
                await runner.command(fault, "slow", {"factor": 1.0})
            res.update(_judge_trainguard(cluster, fault, t0, window, outcome))
    except Exception as exc:  # what ran is reported, the rest pending
        for name in faults:
            results.setdefault(name, {"fault": name, "setup": "c", "label": label})
            if "detect_s" not in results[name]:
                results[name]["pending"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        stop_t = time.time()
        (work / "timeline.txt").write_text(
            "".join(f"{t:.3f} {text}\n" for t, text in cluster.observer.timeline))
        # Measuring is over: the agents and their workers go at once (by pid), which spares
        # their preemption save; then the cluster stops what is left (the control plane).
        tracker.kill({p.pid for n, p in cluster.procs.items() if n in HOSTS})
        with contextlib.suppress(Exception):
            await cluster.nc.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(cluster.stop(), timeout=120)
        watching = False
        await watcher
        tracker.kill({p.pid for p in cluster.procs.values()})
        for res in results.values():
            res["stop_s"] = round(time.time() - stop_t, 1)
    return results


async def _until(cond: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)
    return True


async def _injected(obs: Any, since: int, name: str, task: asyncio.Task[Any],
                    timeout: float) -> float | None:
    """When the runner injected ``name`` (its INJECT timeline entry), None if it did not."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for t, text in obs.timeline[since:]:
            if text.startswith("INJECT") and f" {name} (" in text:
                return float(t)
        if task.done():
            return None
        await asyncio.sleep(0.05)
    return None


def _judge_trainguard(cluster: Any, fault: Any, t0: float, window: float,
                      outcome: Any) -> dict[str, Any]:
    obs = cluster.observer
    end = t0 + window
    anomalies = [a for a in obs.anomalies if a.kind == fault.anomaly
                 and t0 - 1 <= a.detected_at <= end]
    first = min(anomalies, key=lambda a: a.detected_at) if anomalies else None
    recs, _ = read_progress(cluster.progress_file)
    m = measure(recs, t0, window, fault.name)
    out: dict[str, Any] = dataclasses.asdict(m)
    out["detect_s"] = round(max(0.0, first.detected_at - t0), 2) if first else None
    out["anomaly"] = {"kind": first.kind, "ranks": first.ranks} if first else None
    limit = getattr(first.evidence, "limit", None) if first else None
    if first is not None and limit is not None:  # a hang: the limit it was judged by
        why = getattr(first.evidence, "unclear", "")
        out["anomaly"]["limit"] = (f"{limit:.2f} s ({first.evidence.limit_basis}"
                                   + (f": {why})" if why else ")"))
    # The incident: the runner's, else the first one that moved after the fault.
    inc = None
    if outcome is not None:
        out["cause"], out["actions"] = outcome.cause, outcome.actions
        out["incident_status"], out["problems"] = outcome.incident_status, outcome.problems
        out["incident_steps_lost"] = outcome.steps_lost
        out["resolved_s"] = round(outcome.recovered_at - t0, 2) if outcome.recovered_at \
            else None
    else:
        # The incident that holds the fault's anomaly, else the first one that moved after it.
        if first is not None:
            inc = next((i for i in obs.incidents.values() if first.id in i.anomaly_ids), None)
        moved = [text.split()[1] for t, text in obs.timeline
                 if t0 <= t <= end and text.startswith("incident")]
        for suffix in moved if inc is None else []:
            inc = next((i for i in obs.incidents.values() if i.id.endswith(suffix)), None)
            if inc is not None:
                break
        out["problems"] = ["the runner saw no resolved incident for it within the window"]
        if inc is not None:
            out["cause"], out["incident_status"] = inc.cause, inc.status
            out["actions"] = [f"{a.action}:{a.status}" for a in inc.actions]
            out["incident_steps_lost"] = inc.steps_lost
    # Where the recovery's time went, as the re-formed group's rank 0 reported it.
    back = [i.recovery for i in obs.incidents.values() if i.recovery is not None
            and i.recovery.back_at is not None and t0 <= i.recovery.back_at <= end]
    out["phases"] = back[0].phases if back else {}
    out["agent_phases"] = back[0].agent_phases if back else {}
    return out


# -- report ------------------------------------------------------------------------------------

def fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} s"


def cells(r: dict[str, Any]) -> dict[str, str]:
    """The table's cells for one row: measured numbers, or why there is none."""
    if "pending" in r:
        return {"detect": "pending", "first": "pending", "recover": "pending",
                "steps_lost": "pending", "goodput": "pending", "notes": r["pending"][:120]}
    if "error" in r:
        return {"detect": "error", "first": "error", "recover": "error", "steps_lost": "-",
                "goodput": "-", "notes": r["error"][:120]}
    fault, w = r["fault"], r["window_s"]
    trainguard = r["setup"] == "c"
    default_timeout = r.get("pg_timeout_s") == DEFAULT_PG_TIMEOUT
    bound = f"> {w:.0f} s bound" + (" (default 30 min)" if default_timeout else "")
    never_noticed = not trainguard and fault in ("straggler", "nan")
    if r["detect_s"] is not None:
        detect = fmt_s(r["detect_s"])
    else:
        detect = "not detected" if never_noticed else bound
    notes = []
    if r["recover_s"] is not None:
        recover = fmt_s(r["recover_s"])
    elif r.get("restart_failed"):
        recover = "restart failed"
        notes.append("restart failed: Gloo connectFullMesh failed")
    elif never_noticed or (r["detect_s"] is None and trainguard):
        recover = "never (not detected)" if never_noticed else bound
    elif fault == "straggler" and trainguard:
        recover = f"> {w:.0f} s bound (alert only)"
    else:
        recover = bound
    if fault == "nan" and r["restarts"] == 0 and r.get("resume_step") is None \
            and r.get("poisoned_steps"):
        lost = f"{r['poisoned_steps']} (every step since the onset, still going)"
    elif r["steps_lost"] is not None:
        lost = str(r["steps_lost"])
    elif fault == "straggler":
        lost = "0"
    else:
        lost = "- (restart failed)" if r.get("restart_failed") else \
            "- (no progress after the restart)" if r["detect_s"] is not None else \
            "- (no restart)"
    goodput = "-" if r["goodput"] is None else f"{r['goodput']:.2f}"
    if trainguard:
        if r.get("restarts"):
            notes.append(f"resumed at step {r['resume_step']}")
        elif r.get("resume_step") is not None:
            notes.append(f"no process restarted, resumed at step {r['resume_step']}")
        if r["detect_s"] is not None and fault == "nan" and r.get("first_step_s") is not None:
            notes.append(f"rolled back {r['first_step_s'] - r['detect_s']:.1f} s after "
                         "detection")
        elif r["detect_s"] is not None and r["recover_s"] is not None:
            notes.append(f"back {r['recover_s'] - r['detect_s']:.1f} s after detection")
        if (r.get("anomaly") or {}).get("limit"):
            notes.append(f"judged at {r['anomaly']['limit']}")
        if r.get("cause"):
            acts = ", ".join(a.split(":")[0] for a in r.get("actions") or [])
            notes.append(f"{r['cause']}" + (f" -> {acts}" if acts else ""))
        notes.extend(p[:160] for p in r.get("problems") or [])
    else:
        if r.get("restarts"):
            notes.append(f"restarted, resumed at step {r['resume_step']}")
        elif r["detect_s"] is not None and not r.get("restart_failed") \
                and not any(v is not None for v in r.get("agents_exited", {}).values()):
            notes.append("the agents restarted the workers; they made no progress in the window")
        if r.get("covers"):
            notes.append(r["covers"])
    first = fmt_s(r.get("first_step_s")) if r.get("first_step_s") is not None else \
        ("-" if never_noticed or fault == "straggler" else f"> {w:.0f} s bound")
    return {"detect": detect, "first": first, "recover": recover, "steps_lost": lost,
            "goodput": goodput, "notes": "; ".join(notes)}


def table(rows: list[dict[str, Any]], windows: dict[str, float]) -> str:
    out = ["| fault | system | detected | first step after the fault | back where it was | "
           "steps lost | goodput (window) | notes |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        c = r["cells"]
        out.append(f"| {r['fault']} | {r['label']} | {c['detect']} | {c['first']} | "
                   f"{c['recover']} | {c['steps_lost']} | {c['goodput']} "
                   f"({windows[r['fault']]:.0f} s) | {c['notes']} |")
    return "\n".join(out)


def plan(faults: list[str], setups: list[str]) -> list[tuple[str, str, str, str]]:
    """(fault, setup key, row label, what the row covers) of every baseline run."""
    return [(f, key, SETUPS[key].label, "") for f in faults for key in setups]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write results as JSON here")
    p.add_argument("--quick", action="store_true", help="shorter observation windows")
    p.add_argument("--faults", default=",".join(DEFAULT_FAULTS),
                   help=f"comma list of {', '.join(FAULT_NAMES)} "
                        f"(default: {','.join(DEFAULT_FAULTS)})")
    p.add_argument("--setups", default="torchrun,nvrx",
                   help=f"baselines, comma list of {', '.join(SETUPS)} (default: torchrun,nvrx)")
    p.add_argument("--no-baselines", action="store_true", help="only (c) trainguard")
    p.add_argument("--no-trainguard", action="store_true", help="only the torchrun baselines")
    p.add_argument("--trainguard", default=",".join(TRAINGUARD_VARIANTS),
                   help=f"trainguard's runs, comma list of {', '.join(TRAINGUARD_VARIANTS)} "
                        f"(default: both)")
    p.add_argument("--parallel", choices=PARALLEL, default="dp",
                   help="how the trainer spreads the model, in every setup: dp (replicated, "
                        "default), fsdp (FSDP2 over the 4 ranks) or hsdp (2x2 HSDP)")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default=None,
                   help="the trainer's optimizer, in every setup (default: sgd for dp, "
                        "adamw for fsdp and hsdp)")
    p.add_argument("--workdir", help="keep logs and progress files here (default: a temp dir)")
    args = p.parse_args()
    spread = Spread(args.parallel, args.optimizer or ("sgd" if args.parallel == "dp"
                                                      else "adamw"))
    asked = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in asked if f not in FAULT_NAMES]
    if unknown:
        p.error(f"unknown fault(s) {', '.join(unknown)}; known: {', '.join(FAULT_NAMES)}")
    faults = [f for f in FAULT_NAMES if f in asked]
    variants = [v.strip() for v in args.trainguard.split(",") if v.strip()]
    if not variants or any(v not in TRAINGUARD_VARIANTS for v in variants):
        p.error(f"--trainguard {args.trainguard!r}: a comma list of "
                f"{', '.join(TRAINGUARD_VARIANTS)}")
    setups = [k.strip() for k in args.setups.split(",") if k.strip()]
    bad = [k for k in setups if k not in SETUPS]
    if bad:
        p.error(f"unknown setup(s) {', '.join(bad)}; known: {', '.join(SETUPS)}")
    if "nvrx" in setups and not args.no_baselines:
        print(f"NVRx venv: {nvrx_python()}", file=sys.stderr, flush=True)
    from torch.distributed.constants import default_pg_timeout

    if default_pg_timeout.total_seconds() != DEFAULT_PG_TIMEOUT:
        print(f"note: torch's default process-group timeout is {default_pg_timeout}, "
              f"not 30 min", file=sys.stderr)
    windows = QUICK_WINDOWS if args.quick else WINDOWS
    started = time.time()
    tracker = Tracker()
    with _workdir(args.workdir) as root:
        try:
            rows: list[dict[str, Any]] = []
            if not args.no_baselines:
                for fault, key, label, covers in plan(faults, setups):
                    print(f"running {fault} under {label} ...", file=sys.stderr, flush=True)
                    r = run_baseline(fault, SETUPS[key], windows[fault], root, tracker,
                                     spread)
                    r["label"], r["covers"] = label, covers
                    rows.append(r)
            tg: list[dict[str, Any]] = []
            # The baselines save every CKPT_EVERY steps: trainguard's coordinator gets the
            # same period in seconds, from their clean step time.
            clean = [r["clean_step_s"] for r in rows if r.get("clean_step_s")]
            interval_s = CKPT_EVERY * statistics.median(clean) if clean else None
            for variant in [] if args.no_trainguard else variants:
                print(f"running {TRAINGUARD_VARIANTS[variant]} ({', '.join(faults)}) ...",
                      file=sys.stderr, flush=True)
                tg.extend(asyncio.run(run_trainguard(faults, windows, root, tracker,
                                                     variant, spread, interval_s)).values())
        finally:
            tracker.close()
    for r in tg:
        r.setdefault("window_s", windows[r["fault"]])
    ordered = [r for f in faults for r in [*(x for x in rows if x["fault"] == f),
                                           *(x for x in tg if x["fault"] == f)]]
    for r in ordered:
        r["cells"] = cells(r)
    total = time.time() - started
    print(table(ordered, windows))
    ratios = versus_best_baseline(ordered)
    for key, ratio in ratios.items():
        print(f"\n{key}: back where it was in {ratio:.2f}x the best baseline's time")
    for r in ordered:
        if r.get("phases"):
            print(f"\n{r['fault']}, {r['label']}: recovery phases (rank 0) "
                  + ", ".join(f"{k} {v:.2f} s" for k, v in r["phases"].items()))
        if r.get("agent_phases"):
            print(f"{r['fault']}, {r['label']}: inside replacement, the failed rank's agent: "
                  + ", ".join(f"{k} {v:.3f} s" for k, v in r["agent_phases"].items()))
    print(f"\njob: 4 ranks (2 agents x 2), toy_trainer --model lm --step-time {STEP_TIME} "
          f"--parallel {spread.parallel} --optimizer {spread.optimizer}, "
          f"checkpoint every {CKPT_EVERY} steps; faults at step {FAULT_STEP} (baselines), "
          f"on rank {FAULT_RANK} (NaN: rank {NAN_RANK}); goodput = new steps in the window x "
          f"clean step time / window; {'quick' if args.quick else 'full'} run took "
          f"{total / 60:.1f} min\nmachine: {machine()}")
    result = {"mode": "quick" if args.quick else "full", "windows_s": windows,
              "job": {"ranks": 4, "agents": list(HOSTS), "model": "lm", "step_time": STEP_TIME,
                      "parallel": spread.parallel, "optimizer": spread.optimizer,
                      "ckpt_every": CKPT_EVERY, "fault_step": FAULT_STEP,
                      "fault_rank": FAULT_RANK, "nan_rank": NAN_RANK,
                      "slow_factor": SLOW_FACTOR, "max_restarts": MAX_RESTARTS,
                      "short_pg_timeout_s": SHORT_PG_TIMEOUT,
                      "default_pg_timeout_s": DEFAULT_PG_TIMEOUT},
              "rows": ordered, "versus_best_baseline": ratios, "machine": machine(),
              "seconds": round(total, 1)}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2, default=str)
    return 0


def versus_best_baseline(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per fault and trainguard run: its time back where it was over the best baseline's."""
    out: dict[str, float] = {}
    for fault in sorted({r["fault"] for r in rows}):
        base = [r["recover_s"] for r in rows if r["fault"] == fault and r["setup"] != "c"
                and r.get("recover_s") is not None]
        for mine in (r for r in rows if r["fault"] == fault and r["setup"] == "c"):
            if mine.get("recover_s") is not None and base:
                out[f"{fault}, {mine['label']}"] = round(mine["recover_s"] / min(base), 2)
    return out


def machine() -> str:
    import platform

    return (f"{platform.machine()}, {os.cpu_count()} cores, Python "
            f"{platform.python_version()}, torch {_torch_version()}, load average "
            f"{os.getloadavg()[0]:.1f} at the end")


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


@contextlib.contextmanager
def _workdir(path: str | None) -> Iterator[Path]:
    if path:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
        yield Path(tmp)


if __name__ == "__main__":
    sys.exit(main())
