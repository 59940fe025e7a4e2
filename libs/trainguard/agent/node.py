"""The local side of the agent: the node's workers, and what can be done to them.

The supervisor (main thread) tells this object when workers start and exit;
commands (transport thread) act on the same worker table. Exits are reported as
``WorkerExit`` with ``initiated_by`` set for the ones the agent itself caused, so the
detector does not mistake a restart for a crash, and ``launcher`` for the group teardown
that follows another worker's failure.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from trainguard.contract.envelope import uuid7
from trainguard.contract.evidence import HostFacts
from trainguard.contract.schemas import (
    PASSIVE_PREFLIGHT_CHECKS,
    FlightRecorderReport,
    GpuStats,
    PreflightReport,
    ProcessState,
    RecoveryReport,
    WorkerExit,
    XidEvent,
    is_stopped,
)
from trainguard.health import preflight
from trainguard.health.probe import HostProbe
from trainguard.health.settings import CHECKS

from . import flightrec, hostmem, procs
from .exitcodes import EXIT_HELD, EXIT_ISOLATED
from .gpu import GpuSource, ScriptedSource
from .settings import AgentSettings

log = logging.getLogger("trainguard.agent")

LAUNCHER = "launcher"
FLIGHT_RECORDER_PREFIX = "nccl_trace_rank_"
"""Flight-recorder dumps land in the launch log dir as <prefix><rank>: exit evidence."""


@dataclass
class Worker:
    rank: int
    local_rank: int
    pid: int
    stderr: str | None


@dataclass(frozen=True)
class Failure:
    """What the elastic launcher saw of one exited worker (torch-independent)."""

    rank: int
    local_rank: int
    pid: int
    exitcode: int
    message: str = ""


class LocalNode:
    def __init__(self, settings: AgentSettings, *, hosts_store: bool,
                 gpu: GpuSource | None, publish_exit: Callable[[WorkerExit], None],
                 log_dir: str = "") -> None:
        self.log_dir = log_dir
        self.settings = settings
        self.host = settings.host
        self.hosts_store = hosts_store
        self.drills_allowed = settings.allow_drills
        self.gpu = gpu
        self._publish_exit = publish_exit
        self.publish_fr: Callable[[FlightRecorderReport], None] | None = None
        """Where flight-recorder dumps collected on ``dump`` go (the launcher's link)."""
        self.publish_recovery: Callable[[RecoveryReport], None] | None = None
        """Where the agent says why a failure got the group restart and not the in-place
        replacement (the launcher's link; ``recovery.<rank>``)."""
        self.oom = hostmem.OomWatch()
        self.probe = HostProbe(settings)
        """The straggler checklist's reading of this host, sent with each GPU sample."""
        self.publish_preflight: Callable[[PreflightReport], None] | None = None
        """Where a pre-flight record goes (the launcher's link; ``event.preflight``)."""
        self._lock = threading.Lock()
        self.workers: dict[int, Worker] = {}
        self.initiated: dict[int, str] = {}
        self.restart_count = 0
        self.isolating: str | None = None
        self.stopping: str | None = None
        self.holding: str | None = None
        """The id of the ``hold`` that ends this launcher (exit ``EXIT_HELD``), once one came."""
        self.generation = 0
        """The job's generation this node's ranks belong to (the newest one it knows)."""
        self.spare_pids: Callable[[], list[int]] = list
        """The pids of the idle warm spares ready to become a rank (the pool's)."""
        self.rank_restarter: Callable[[int, str, float, str], str] | None = None
        """Restarts one local rank alone: (local rank, command id, timeout, fallback) ->
        detail."""
        self.mark_group_restart: Callable[[str], None] = lambda by: None
        """Says in the job store that command ``by`` stops this node's ranks so the group
        restarts (the rendezvous'): the other nodes' ranks' exits on their lost peers are
        then the command's."""
        self.restarting_since: float | None = None
        """Since when the worker group is restarting (a failure seen or a ``restart``
        command), until the new group started: the node heartbeat says so, so the detector
        reads the restart's silence as a restart and not as failing ranks."""

    # -- from the elastic agent (main thread) -----------------------------------------
    def workers_started(self, workers: list[Worker], restart_count: int) -> None:
        with self._lock:
            self.workers = {w.rank: w for w in workers}
            self.initiated = {}
            self.restart_count = restart_count
            self.restarting_since = None
        log.info("workers started on %s (attempt %d): %s", self.host, restart_count,
                 {w.rank: w.pid for w in workers})

    def worker_replaced(self, worker: Worker, restart_count: int) -> None:
        """One rank was replaced alone (the others run on)."""
        with self._lock:
            self.workers[worker.rank] = worker
            self.restart_count = restart_count
            self.restarting_since = None
        log.info("rank %d replaced on %s: pid %d", worker.rank, self.host, worker.pid)

    def workers_renumbered(self, ranks: Mapping[int, int]) -> None:
        """The group re-formed in place without another host: old rank -> new rank of each
        of this node's workers (the pids stay)."""
        with self._lock:
            for w in self.workers.values():
                w.rank = ranks.get(w.rank, w.rank)
            self.workers = {w.rank: w for w in self.workers.values()}
        log.info("workers renumbered on %s: %s", self.host,
                 {w.rank: w.pid for w in self.workers.values()})

    def workers_exited(self, failures: Mapping[int, Failure], succeeded: bool) -> None:
        """Publish one WorkerExit per worker that ended; decide who caused each."""
        now = time.time()
        with self._lock:
            workers = dict(self.workers)
            initiated = dict(self.initiated)
        if succeeded:
            for w in workers.values():
                self._publish_exit(self._exit(w, 0, None, "", now))
            return
        if self.ended_by is None:
            self.restart_began(now)  # torchrun restarts the group (or gives up and exits)
        independent = [f for f in failures.values()
                       if f.pid not in initiated and f.exitcode != -signal.SIGTERM]
        for f in failures.values():
            w = workers.get(f.rank) or Worker(f.rank, f.local_rank, f.pid, None)
            if f.pid in initiated:
                by: str | None = initiated[f.pid]
            elif f.exitcode == -signal.SIGTERM and (independent or initiated):
                by = LAUNCHER  # the teardown that follows another worker's failure
            else:
                by = None
            self._publish_exit(self._exit(w, f.exitcode, by, f.message, now))

    def _exit(self, w: Worker, code: int, by: str | None, message: str,
              now: float) -> WorkerExit:
        sig = None
        if code < 0:
            try:
                sig = signal.Signals(-code).name
            except ValueError:
                sig = f"SIG{-code}"
        error = message if message and not message.startswith("Signal") else ""
        if code != 0 and by is None:
            oom = self.oom.evidence()
            if not oom and code in (-signal.SIGKILL, 128 + signal.SIGKILL) \
                    and self.oom.counting:
                # A SIGKILL the OOM counters did not see: not the OOM killer's.
                oom = f"{hostmem.NO_OOM} (cgroup oom_kill unchanged)"
            if oom:
                error = (error + "\n" if error else "") + oom
        if self.log_dir:
            dumps = flightrec.dump_files(self.log_dir, FLIGHT_RECORDER_PREFIX, w.rank)
            if dumps:
                error = (error + "\n" if error else "") + "flight recorder: " + ", ".join(dumps)
        return WorkerExit(id=uuid7(), job=self.settings.job, host=self.host, rank=w.rank,
                          local_rank=w.local_rank, pid=w.pid, exit_code=code, signal=sig,
                          stderr_tail=procs.stderr_tail(w.stderr, 4096), error=error,
                          initiated_by=by, attempt=self.restart_count,
                          generation=self.generation, time=now)

    def workers_stopped(self, command_id: str) -> None:
        """Report the exits of a stop or isolation: the supervisor tore the workers down
        without a monitor pass, so nobody else will, and the detector must know they were
        meant (or it would call the vanished processes a crash)."""
        now = time.time()
        with self._lock:
            workers = list(self.workers.values())
        for w in workers:
            self._publish_exit(self._exit(w, -signal.SIGTERM, command_id, "", now))

    # -- for the executor (commands) ---------------------------------------------------
    def rank_pids(self) -> dict[int, int]:
        with self._lock:
            return {r: w.pid for r, w in self.workers.items()}

    def states(self) -> tuple[dict[int, ProcessState], dict[int, int]]:
        pids = self.rank_pids()
        return {r: procs.state_of(p) for r, p in pids.items()}, pids

    def _mark(self, command_id: str) -> list[int]:
        with self._lock:
            pids = [w.pid for w in self.workers.values()]
        self.initiate_pids(pids, command_id)
        return pids

    def initiate_pids(self, pids: Iterable[int], by: str, *, keep: bool = False) -> None:
        """``keep``: an exit a command already caused stays the command's."""
        with self._lock:
            for pid in pids:
                if not (keep and pid in self.initiated):
                    self.initiated[pid] = by

    def initiated_by(self, pid: int) -> str | None:
        """The command (or ``launcher``) that stopped ``pid``, if one did."""
        with self._lock:
            return self.initiated.get(pid)

    def report_fallback(self, rank: int, reason: str, world_size: int) -> None:
        """Say why ``rank``'s failure restarts the whole group from the committed
        checkpoint instead of replacing it in place (the incident records it)."""
        log.info("rank %d: group restart, not in place: %s", rank, reason)
        if self.publish_recovery is None:
            return
        self.publish_recovery(RecoveryReport(
            id=uuid7(), job=self.settings.job, rank=rank, kind="replace", path="restart",
            reason=reason, generation=self.generation, previous_generation=self.generation,
            world_size=world_size, attempt=self.restart_count, time=time.time()))

    def report_replaced(self, rank: int, generation: int, world_size: int, detail: str, *,
                        phases: Mapping[str, float] | None = None) -> None:
        """Say that ``rank`` was replaced in place at ``generation``: the launcher's restart
        of the failure, done, and where its time went (``phases``: from the exit found to
        the replacement started); the re-formed group's lowest rank reports the rest once
        it runs: source, resumed step, steps lost, seconds."""
        if self.publish_recovery is None:
            return
        self.publish_recovery(RecoveryReport(
            id=uuid7(), job=self.settings.job, rank=rank, kind="replace", path="in_place",
            reason=detail, generation=generation, previous_generation=generation - 1,
            world_size=world_size, joined=[rank], phases=dict(phases or {}),
            attempt=self.restart_count, time=time.time()))

    def report_resized(self, rank: int, generation: int, world_size: int, detail: str, *,
                       kind: Literal["resize", "grow"] = "resize") -> None:
        """Say that the group re-forms in place at ``generation`` without this host
        (``resize``; ``rank``: the lowest that leaves) or with it taken back (``grow``;
        ``rank``: its first): the change is under way; the new group's rank 0 reports the
        rest once it runs."""
        if self.publish_recovery is None:
            return
        self.publish_recovery(RecoveryReport(
            id=uuid7(), job=self.settings.job, rank=rank, kind=kind, path="in_place",
            reason=detail, generation=generation, previous_generation=generation - 1,
            world_size=world_size, attempt=self.restart_count, time=time.time()))

    def restart_began(self, now: float | None = None) -> None:
        """The worker group is going down to be started again (idempotent per restart)."""
        with self._lock:
            if self.restarting_since is None:
                self.restarting_since = time.time() if now is None else now

    def restart(self, command_id: str) -> str:
        self.restart_began()
        self.mark_group_restart(command_id)
        pids = self._mark(command_id)
        procs.terminate(pids, self.settings.stop_grace)
        return f"stopped {len(pids)} local worker(s); the launcher restarts the group"

    def restart_rank(self, rank: int, command_id: str, fallback: str = "") -> str:
        """Restart one rank alone, at a new generation (the others keep running); in place
        when the group can take it, else ``fallback="group"`` restarts the group."""
        with self._lock:
            worker = self.workers.get(rank)
        if worker is None or self.rank_restarter is None:
            raise ProcessLookupError(f"rank {rank} does not run on host {self.host}")
        return self.rank_restarter(worker.local_rank, command_id,
                                   self.settings.stop_grace + 60, fallback)

    def isolate(self, command_id: str) -> str:
        self.isolating = command_id
        self._end_launcher(command_id)
        return f"host {self.host} leaves the job (trainguard launch exits {EXIT_ISOLATED})"

    def stop(self, command_id: str) -> str:
        self.stopping = command_id
        self._end_launcher(command_id)
        return f"stopping the workers on {self.host}"

    def hold(self, command_id: str) -> str:
        """Stop the workers and end the launcher with 80 (EXIT_HELD): the control plane gave
        up on the job (a crash loop past its budget), so torchrun must not restart it again."""
        self.holding = command_id
        self._end_launcher(command_id)
        return (f"holding the job on {self.host}: stopping the workers, trainguard launch exits "
                f"{EXIT_HELD}")

    def _end_launcher(self, command_id: str) -> None:
        self._mark(command_id)
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher stops workers, keeps the rdzv open

    @property
    def ended_by(self) -> str | None:
        """The command that is ending this launcher (isolate, hold or stop), if any."""
        return self.isolating or self.holding or self.stopping

    def dump(self, ranks: list[int], timeout: float = 3.0) -> str:
        pids = self.rank_pids()
        with self._lock:
            files = {r: self.workers[r].stderr for r in ranks if r in self.workers}
        before = {r: procs.file_size(f) for r, f in files.items()}
        # SIGUSR1's default action ends the process: only ranks whose stack-dump handler is
        # installed get it (a rank still importing would die of the dump).
        unready = [r for r in ranks if r in pids and not procs.catches(pids[r], signal.SIGUSR1)]
        for r in ranks:
            if r in pids and r not in unready:
                procs.send(pids[r], signal.SIGUSR1)
        # faulthandler writes from a C signal handler: wait until every rank's stack has
        # landed in its stderr file (or the timeout). A stopped rank cannot write: skip it.
        deadline = time.monotonic() + timeout
        waiting = {r: f for r, f in files.items() if r in pids and r not in unready
                   and not is_stopped(procs.state_of(pids[r]))}
        while waiting and time.monotonic() < deadline:
            for r, f in list(waiting.items()):
                if procs.STACK_MARK in procs.read_from(f, before[r]):
                    del waiting[r]
            if waiting:
                time.sleep(0.05)
        parts = [f"--- rank {r} (pid {pids[r]}) stderr tail ---\n"
                 + ("(no stack dump: its handler is not installed yet, so it was not "
                    "signalled)\n" if r in unready else "")
                 + procs.stderr_tail(files.get(r), 6000) for r in ranks]
        if self.log_dir and self.publish_fr is not None:  # every local rank's, for the diagnoser
            stopped = {r for r, p in pids.items() if is_stopped(procs.state_of(p))}
            fr = flightrec.collect(self.log_dir, os.path.join(self.log_dir,
                                   FLIGHT_RECORDER_PREFIX), pids, stopped)
            self.publish_fr(flightrec.report(self.settings.job, self.host, fr,
                                             self.restart_count))
            parts.insert(0, flightrec.summary(fr))
        return "\n".join(parts)

    def signal_rank(self, rank: int, action: str) -> str:
        pid = self.rank_pids()[rank]
        sig = {"kill": signal.SIGKILL, "freeze": signal.SIGSTOP, "thaw": signal.SIGCONT}[action]
        if not procs.send(pid, sig):
            raise ProcessLookupError(f"rank {rank} (pid {pid}) is not running")
        return f"{sig.name} sent to rank {rank} (pid {pid})"

    def gpu_drill(self, kind: str, params: dict[str, object]) -> str:
        if not isinstance(self.gpu, ScriptedSource):
            raise RuntimeError("GPU drills need the scripted GPU source (--allow-drills)")
        gpu = int(str(params.get("gpu", 0)))
        if kind == "ecc":
            count = int(str(params.get("count", 1)))
            self.gpu.inject_ecc(gpu, count)
            return f"scripted {count} uncorrectable ECC error(s) on GPU {gpu}"
        if kind == "xid":
            code = int(str(params.get("code", 79)))
            self.gpu.inject_xid(code, gpu)
            return f"scripted XID {code} on GPU {gpu}"
        reasons = params.get("reasons") or ["hw_power_brake_slowdown"]
        self.gpu.inject_throttle([str(r) for r in reasons]
                                 if isinstance(reasons, list) else [str(reasons)], gpu)
        return f"scripted throttling {reasons} on GPU {gpu}"

    def gpu_reading(self) -> tuple[list[GpuStats], list[XidEvent]] | None:
        if self.gpu is None:
            return None
        return self.gpu.sample(), self.gpu.xids()

    def own_pids(self) -> set[int]:
        """The processes that are the job's on this node: its ranks and warm spares."""
        return set(self.rank_pids().values()) | set(self.spare_pids())

    def host_facts(self, gpus: list[GpuStats]) -> HostFacts:
        return self.probe.facts(gpus, self.own_pids())

    def preflight(self, checks: list[str] | None = None, *,
                  trigger: Literal["launch", "command"] = "command") -> PreflightReport:
        """Run the pre-flight (``checks``: the settings' when None) and publish its record.
        On a command the ranks run, so by default only the passive checks run: the
        bandwidth test and ``dcgmi diag`` would compete with training for the GPUs."""
        if checks is None:
            checks = self.settings.checks() if trigger == "launch" else \
                [c for c in self.settings.checks() if c in PASSIVE_PREFLIGHT_CHECKS]
        unknown = [c for c in checks if c not in CHECKS]
        if unknown:
            raise ValueError(f"unknown pre-flight check {unknown[0]!r}; known: "
                             f"{', '.join(CHECKS)}")
        reading = self.gpu_reading()
        real = self.gpu.real_gpus() if isinstance(self.gpu, ScriptedSource) else None
        report = preflight.run(self.settings, job=self.settings.job, host=self.host,
                               gpus=reading[0] if reading else None,
                               gpu_why="no GPU source on this node (NVML unavailable)",
                               own=self.own_pids(), trigger=trigger, only=checks, devices=real)
        if self.publish_preflight is not None:
            self.publish_preflight(report)
        return report

    def preflight_summary(self, checks: list[str] | None) -> str:
        """A ``preflight`` command: the record goes out as an event; the ack says how it
        went."""
        report = self.preflight(checks, trigger="command")
        return f"preflight {report.status}" + (f": {report.reason()}" if report.reason() else "")
