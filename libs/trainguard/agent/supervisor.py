"""Per-rank supervision of the node's ranks: trainguard's own elastic agent.

One loop on the launcher's main thread: join a rendezvous round (:mod:`.rendezvous`),
start the node's ranks (each from a warm spare where one is ready, else a cold
``python``), watch them, and on a failure stop the rest and re-form the group at a new
generation (torchrun's semantics: ``--max-restarts`` failures, membership changes free).
Besides the whole group it restarts **one rank alone** (:meth:`Supervisor.restart_rank`):
the rank is replaced at a new job-wide generation while the others keep running. When one
rank fails and every rank of the generation declared in-place recovery (:mod:`.inplace`),
that is what a failure gets too: the replacement starts with ``TRAINGUARD_JOIN=peers``
(its state comes from the survivors), at the survivors' attempt, and nobody else restarts.
The process table it keeps is :class:`LocalNode`'s, so
heartbeats, exits and commands see the pid that really runs each rank (a spare's, once
it became one).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Final

from trainguard.contract import envnames, timeline
from trainguard.contract.errors import TrainguardError
from trainguard.recovery import groupstore
from trainguard.recovery import path as inplace

from . import procs
from .node import LAUNCHER, Failure, LocalNode, Worker
from .output import OutputTail, rank_files
from .rendezvous import JobRendezvous, Round
from .spare import SpareOrder
from .spares import SparePool

log = logging.getLogger("trainguard.agent")


RANK_FIELD: Final = "{rank}"
"""Where a ``rank_credentials`` path names each rank's own file, the rank's number goes."""
LOCAL_FIELD: Final = "{local_rank}"
"""Or the process's local rank: the agent's own files (``jwt`` mode), which keep their
path when the process is renumbered and get the new number's credential."""


@dataclass(frozen=True)
class Program:
    """What every rank runs: ``python -u [-m] target args`` (or the target itself with
    ``--no-python``, which no spare can run). ``python`` is torchrun's: ``PYTHON_EXEC``,
    else the launcher's interpreter (the spares'; another one starts cold)."""

    target: str
    args: list[str]
    module: bool = False
    no_python: bool = False
    python: str = field(default_factory=lambda: os.environ.get("PYTHON_EXEC", sys.executable))

    @property
    def warmable(self) -> bool:
        return not self.no_python and self.python == sys.executable

    def argv(self) -> list[str]:
        if self.no_python:
            return [self.target, *self.args]
        return [self.python, "-u", *(["-m"] if self.module else []), self.target, *self.args]


@dataclass
class RankProc:
    local_rank: int
    rank: int
    popen: subprocess.Popen[bytes]
    stdout: str
    stderr: str
    error_file: str
    warm: bool

    @property
    def pid(self) -> int:
        return self.popen.pid


@dataclass
class _Request:
    local_rank: int
    by: str
    fallback: str = ""
    done: threading.Event = field(default_factory=threading.Event)
    answer: str = ""
    error: str = ""


class SupervisionError(TrainguardError):
    """A rank restart could not be carried out."""


class Supervisor:
    def __init__(self, *, node: LocalNode, rdzv: JobRendezvous, program: Program,
                 nproc: int, max_restarts: int, log_dir: str, spares: SparePool,
                 stop_grace: float, monitor_interval: float = 0.1,
                 refill_delay: float = 1.0, in_place: bool = True,
                 credentials: Callable[[int, int], None] | None = None,
                 renumbered: Callable[[dict[int, int]], None] | None = None) -> None:
        self.node = node
        self.credentials = credentials
        """Makes sure the credential file of a local rank holds its global rank's before
        it starts (``jwt`` mode: obtained from the control plane's issuer)."""
        self.renumbered = renumbered
        """Told the ranks renumbered in place (old -> new: ``jwt`` mode, their files then
        get the new numbers' credentials)."""
        self.rdzv = rdzv
        self.program = program
        self.nproc = nproc
        self.max_restarts = max_restarts
        self.log_dir = log_dir
        self.spares = spares
        self.stop_grace = stop_grace
        self.monitor_interval = monitor_interval
        self.refill_delay = refill_delay
        self.in_place = in_place
        self.remaining = max_restarts
        """Restarts left (``--max-restarts``); an in-place replacement spends one too."""
        self.restart_count = 0
        self.group: dict[int, RankProc] = {}
        self.round: Round | None = None
        self.tail = OutputTail()
        self._requests: queue.SimpleQueue[_Request] = queue.SimpleQueue()
        self._refill_at: float | None = None
        self._left = False
        """:meth:`leaving` ran (it runs once)."""
        self._ended: tuple[float, float, float] | None = None
        """The last group's end: failure seen, group restart decided, ranks stopped (the
        next group's ranks get it with the round's forming, :func:`restart_stamps`)."""

    # -- the loop ---------------------------------------------------------------------
    def run(self) -> int:
        """Until the job ends here: 0 when the node's ranks succeeded, 1 when they failed
        past ``max_restarts``. Stops every rank and spare on the way out."""
        prefer: list[int] = []
        running: Round | None = None
        try:
            while True:
                rnd = self.rdzv.next_round(self.nproc, running, host=self.node.host,
                                           attempt=self.restart_count)
                formed = time.time()
                if rnd.carried:
                    self._carry_on(rnd)
                else:
                    if running is not None:  # the round could not take the new node in place
                        self.node.restart_began()
                        self._end_group([])
                    self._start_group(rnd, prefer, formed)
                running = None
                kind, failures = self._watch()
                if kind == "take_in" and self.round is not None:
                    # At the generation it follows (a shrink in place moved it on).
                    running = replace(self.round, generation=self.node.generation)
                    continue
                if kind == "succeeded":
                    self.node.workers_exited({}, succeeded=True)
                    # The round as it is now: a node that left in place is not waited for.
                    if (generation := self.rdzv.generation()) is not None:
                        self._follow(generation)
                    self.rdzv.exit_barrier(self.round or rnd)
                    self.rdzv.close()
                    return 0
                prefer = sorted(f.local_rank for f in failures.values()
                                if f.exitcode != -signal.SIGTERM)
                if kind == "failed":
                    if self.remaining <= 0:
                        log.error("ranks failed and no restarts are left (--max-restarts %d)",
                                  self.max_restarts)
                        self.rdzv.close()
                        return 1
                    self.remaining -= 1
                    self.restart_count += 1
        finally:
            self.stop_group()
            self.spares.close()
            self.tail.close()

    def _watch(self) -> tuple[str, dict[int, Failure]]:
        """Until the group ends: ``succeeded``, ``failed`` (a rank exited non-zero: the
        rest are stopped) or ``membership`` (another node waits to re-form the group), with
        every exit that was not 0 (already reported)."""
        next_check = time.monotonic() + 1.0
        while True:
            codes = {lr: p.popen.poll() for lr, p in self.group.items()}
            failed = [self.group[lr] for lr, c in codes.items() if c not in (None, 0)]
            if failed:
                seen = time.time()
                if not self._recover_in_place(failed, seen):
                    return "failed", self._end_group(failed, seen=seen)
            if all(c == 0 for c in codes.values()):
                return "succeeded", {}
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 1.0
                if self.rdzv.nodes_waiting() > 0:
                    if (why := self._why_not_take_in()) is None:
                        log.info("another node waits to join: taking it in place")
                        return "take_in", {}
                    log.info("another node waits to re-form the group: restarting ours (%s)",
                             why)
                    return "membership", self._end_group([])
                generation = self.rdzv.generation()
                if generation is not None:
                    self._follow(generation)
            self._serve_requests()
            if self._refill_at is not None and now >= self._refill_at:
                self.spares.fill()
                self._refill_at = now + 1.0  # keep it full (a spare may die idle)
            procs.wait_exit([p.pid for p in self.group.values() if p.popen.returncode is None],
                            self.monitor_interval)

    # -- starting ranks ---------------------------------------------------------------
    def _start_group(self, rnd: Round, prefer: list[int], formed: float) -> None:
        self.round = rnd
        self.node.generation = rnd.generation
        if rnd.joins and rnd.attempt is not None:
            self.restart_count = rnd.attempt  # the running group's attempt, as a replacement
        order = prefer + [lr for lr in range(self.nproc) if lr not in prefer]
        extra: dict[str, str] = {}
        if self._ended is not None and not rnd.joins:
            warm = min(self.nproc, len(self.spares.ready_pids())) \
                if self.program.warmable else 0
            extra[envnames.RESTART_STAMPS] = timeline.encode_stamps(restart_stamps(
                self._ended, formed, warm=warm, ranks=self.nproc))
        self._ended = None
        self.group = {}
        for lr in order:
            self.group[lr] = self._spawn(lr, rnd.base_rank + lr, rnd.generation,
                                         self.restart_count, join=rnd.joins, extra=extra)
        self.node.workers_started([self._worker(p) for p in self.group.values()],
                                  self.restart_count)
        self._refill_at = time.monotonic() + self.refill_delay
        log.info("group %s on %s: generation %d, ranks %s (warm: %s)",
                 "joined in place" if rnd.joins else "started", self.node.host,
                 rnd.generation, {p.rank: p.pid for p in self.group.values()},
                 [p.rank for p in self.group.values() if p.warm])
        if rnd.joins:
            self.node.report_resized(rnd.base_rank, rnd.generation, rnd.world_size,
                                     f"host {self.node.host} rejoined the job: its ranks "
                                     f"{rnd.base_rank}..{rnd.base_rank + self.nproc - 1} "
                                     f"join the running group in place at {rnd.world_size} "
                                     f"ranks, generation {rnd.generation}", kind="grow")

    def _why_not_take_in(self) -> str | None:
        """Why a waiting node cannot be taken into the running group in place (None: it
        can; the round decides for good, see :mod:`.rendezvous`)."""
        if not self.in_place:
            return "in-place recovery is off for this agent (--no-in-place)"
        if self.round is None or not self.group:
            return "no group runs here"
        if self.rdzv.plan.backend == "static":
            return "the static rendezvous has a fixed set of nodes"
        if any(p.popen.poll() is not None for p in self.group.values()):
            return "a local rank has exited"
        # Ranks still starting (a round that formed before every node came) have nothing
        # to hand on: they restart with the new node, as torchrun's do.
        return inplace.resize_blocker(self.rdzv.in_place_keys(self.node.generation,
                                                              self.round.world_size))

    def _carry_on(self, rnd: Round) -> None:
        """The round took new nodes into the running group: the local ranks go on (they
        re-form at their next command agreement); the round's store is the one the exit
        barrier counts on."""
        self.round = rnd
        log.info("the running group takes new nodes in place: %d ranks on %d node(s)",
                 rnd.world_size, rnd.group_world_size)

    def rank_env(self, rnd: Round, local_rank: int, rank: int, generation: int,
                 restart_count: int, error_file: str, *, join: bool = False) -> dict[str, str]:
        """torchrun's environment contract for one rank, plus the generation it joins
        (``join``: as the in-place replacement of a failed rank, from its peers' state)."""
        env = dict(os.environ)
        env.pop(envnames.JOIN, None)
        env.pop(envnames.RESTART_STAMPS, None)
        if join:
            env[envnames.JOIN] = "peers"
        env.update({
            envnames.RANK: str(rank), "GROUP_RANK": str(rnd.group_rank),
            "ROLE_RANK": str(rank), "ROLE_NAME": "default",
            envnames.LOCAL_RANK: str(local_rank), "LOCAL_WORLD_SIZE": str(self.nproc),
            envnames.WORLD_SIZE: str(rnd.world_size),
            "GROUP_WORLD_SIZE": str(rnd.group_world_size),
            "ROLE_WORLD_SIZE": str(rnd.world_size),
            "MASTER_ADDR": rnd.master_addr, "MASTER_PORT": str(rnd.master_port),
            envnames.RESTART_COUNT: str(restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts),
            "TORCHELASTIC_RUN_ID": self.rdzv.run_id,
            "TORCHELASTIC_USE_AGENT_STORE": str(self.rdzv.use_agent_store),
            "TORCHELASTIC_ERROR_FILE": error_file,
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get(
                "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            envnames.GENERATION: str(generation),
        })
        # Per-rank credentials (``--rank-credentials DIR/rank-J-{rank}.creds``): each rank
        # is handed its own file's path, never another's.
        creds = env.get(envnames.CREDENTIALS, "")
        if RANK_FIELD in creds or LOCAL_FIELD in creds:
            env[envnames.CREDENTIALS] = creds.replace(RANK_FIELD, str(rank)).replace(
                LOCAL_FIELD, str(local_rank))
        return env

    def _spawn(self, local_rank: int, rank: int, generation: int,
               restart_count: int, *, join: bool = False,
               extra: Mapping[str, str] | None = None) -> RankProc:
        assert self.round is not None
        if self.credentials is not None:
            self.credentials(local_rank, rank)
        stdout, stderr = rank_files(self.log_dir, restart_count, local_rank, generation)
        error_file = os.path.join(os.path.dirname(stderr), "error.json")
        env = self.rank_env(self.round, local_rank, rank, generation, restart_count,
                            error_file, join=join)
        env.update(extra or {})
        spare = self.spares.take() if self.program.warmable else None
        if spare is not None:
            p = self.program
            popen = spare.activate(SpareOrder(
                env=env, argv=[p.target, *p.args], cwd=os.getcwd(), stdout=stdout,
                stderr=stderr, module=p.target if p.module else None,
                script=None if p.module else p.target))
        else:
            with open(stdout, "ab") as out, open(stderr, "ab") as err:
                popen = subprocess.Popen(self.program.argv(), env=env, stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=err, start_new_session=True)
        self.tail.watch(stdout, rank, err=False)
        self.tail.watch(stderr, rank, err=True)
        return RankProc(local_rank, rank, popen, stdout, stderr, error_file,
                        warm=spare is not None)

    @staticmethod
    def _worker(p: RankProc) -> Worker:
        return Worker(rank=p.rank, local_rank=p.local_rank, pid=p.pid, stderr=p.stderr)

    # -- stopping ranks ---------------------------------------------------------------
    def _stop(self, ranks: list[RankProc]) -> None:
        """SIGTERM each rank's process group (SIGKILL for stuck ones at once), then
        SIGKILL what is left after the grace period; reaps them."""
        live = [p for p in ranks if p.popen.poll() is None]
        procs.kill_stuck(p.pid for p in live)
        for p in live:
            procs.signal_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace
        while time.monotonic() < deadline and any(p.popen.poll() is None for p in live):
            time.sleep(0.05)
        for p in live:
            if p.popen.poll() is None:
                procs.signal_group(p.pid, signal.SIGKILL)
            p.popen.wait()
        self.tail.forget({f for p in ranks for f in (p.stdout, p.stderr)})

    def stop_group(self) -> None:
        self._stop(list(self.group.values()))

    def _end_group(self, failed: list[RankProc], *, seen: float | None = None
                   ) -> dict[int, Failure]:
        """Report ``failed`` at once (the detector's crash evidence must not wait for the
        teardown), stop the rest (the launcher's doing, unless a command's already) and
        report their exits; the failures of all that did not exit 0. ``seen``: when the
        failure was found (else now, or a restart command's arrival); the restart's
        timeline starts there (:attr:`_ended`)."""
        decided = time.time()
        since = self.node.restarting_since
        seen = min(seen or decided, since or decided)
        first = {p.rank: self._failure(p) for p in failed}
        self.node.initiate_pids([p.pid for p in self.group.values() if p not in failed],
                                LAUNCHER, keep=True)
        if first:
            self.node.workers_exited(first, succeeded=False)
        self.stop_group()
        self._refill_at = None
        rest = {p.rank: self._failure(p) for p in self.group.values()
                if p.rank not in first and p.popen.returncode != 0}
        self.node.workers_exited(rest, succeeded=False)
        self._ended = (seen, decided, time.time())
        return {**first, **rest}

    @staticmethod
    def _failure(p: RankProc) -> Failure:
        return Failure(rank=p.rank, local_rank=p.local_rank, pid=p.pid,
                       exitcode=int(p.popen.returncode), message=error_message(p.error_file))

    # -- one rank alone ---------------------------------------------------------------
    def restart_rank(self, local_rank: int, by: str, timeout: float,
                     fallback: str = "") -> str:
        """Replace one local rank at a new generation, the others untouched (any thread:
        the supervising thread carries it out, since only it may start processes);
        ``fallback="group"``: restart the group when in place is not possible."""
        req = _Request(local_rank, by, fallback)
        self._requests.put(req)
        if not req.done.wait(timeout):
            raise SupervisionError(f"restart of local rank {local_rank} did not finish in "
                                   f"{timeout:.0f} s")
        if req.error:
            raise SupervisionError(req.error)
        return req.answer

    def _serve_requests(self) -> None:
        while True:
            try:
                req = self._requests.get_nowait()
            except queue.Empty:
                return
            try:
                req.answer = self._replace(req.local_rank, req.by, req.fallback)
            except Exception as exc:
                req.error = f"{type(exc).__name__}: {exc}"
            req.done.set()

    def _replace(self, local_rank: int, by: str, fallback: str = "") -> str:
        """A ``restart`` of one rank (``by``: the command): in place when the group can
        take it; else, with ``fallback="group"`` (the remediator's culprit restart), the
        whole group; else that rank alone at a new attempt (today's single-rank restart)."""
        old = self.group.get(local_rank)
        if old is None or self.round is None:
            raise SupervisionError(f"local rank {local_rank} is not running")
        decision = self._decide([old], [])
        if decision.in_place:
            # Killed at once: a hung or frozen rank's sockets close, so the survivors'
            # collective fails now instead of at its timeout.
            self.node.initiate_pids([old.pid], by)
            procs.signal_group(old.pid, signal.SIGKILL)
            old.popen.wait()
            self.tail.forget({old.stdout, old.stderr})
            new = self._replace_in_place(old, self.node.generation)
            if new is not None:
                return (f"rank {old.rank} replaced in place: pid {old.pid} -> {new.pid} "
                        f"({'warm spare' if new.warm else 'cold start'}), generation "
                        f"{self.node.generation}; the other ranks keep running")
            self._stop_all(by)
            return (f"rank {old.rank}: another replacement raced this one; the group "
                    "restarts from the committed checkpoint")
        if fallback == "group":
            self._stop_all(by)
            return (f"rank {old.rank} cannot be replaced in place ({decision.reason}); "
                    f"stopped {len(self.group)} local worker(s): the group restarts")
        self.node.initiate_pids([old.pid], by)
        self._stop([old])
        self.node.workers_exited({old.rank: self._failure(old)}, succeeded=False)
        generation = self.rdzv.bump_generation()
        self.restart_count += 1
        new = self._spawn(local_rank, old.rank, generation, self.restart_count)
        self._took_over(new, generation)
        return (f"rank {old.rank} restarted alone: pid {old.pid} -> {new.pid} "
                f"({'warm spare' if new.warm else 'cold start'}), generation {generation}")

    def _stop_all(self, by: str) -> None:
        """Stop every local rank for command ``by``: the next poll sees them gone and
        restarts the group (their exits are the command's)."""
        self.node.restart_began()
        self.node.mark_group_restart(by)
        self.node.initiate_pids([p.pid for p in self.group.values()], by)
        self._stop(list(self.group.values()))

    def _took_over(self, new: RankProc, generation: int) -> None:
        self.group[new.local_rank] = new
        self.node.generation = generation
        self.node.worker_replaced(self._worker(new), self.restart_count)
        self._refill_at = time.monotonic() + self.refill_delay

    # -- in place ---------------------------------------------------------------------
    def _follow(self, generation: int) -> None:
        """The job's generation rose to ``generation``: adopt the sizes another node's
        leaving gave it (:meth:`leaving`), so a later replacement joins at the right size
        and the exit barrier counts the nodes that are left."""
        seen = self.node.generation
        if generation > seen and self.round is not None:
            records = self.rdzv.resizes(seen, generation)
            if records is None:
                return  # the store did not answer: read them again at the next look
            for gen, resize in records:
                self._adopt(gen, resize)
        self.node.generation = generation

    def _adopt(self, generation: int, resize: groupstore.Resize) -> None:
        """Another node left in place: the local ranks close up the gap it left (their
        processes, and so their pids, stay)."""
        assert self.round is not None
        renumbered = {p.rank: new for p in self.group.values()
                      if (new := resize.new_rank(p.rank)) is not None and new != p.rank}
        for p in self.group.values():
            p.rank = renumbered.get(p.rank, p.rank)
        if renumbered:
            self.node.workers_renumbered(renumbered)
            if self.renumbered is not None:
                self.renumbered(renumbered)
        base = min((p.rank for p in self.group.values()), default=self.round.base_rank)
        group_rank = self.round.group_rank - (0 <= resize.node < self.round.group_rank)
        self.round = replace(self.round, world_size=resize.world_size,
                             group_world_size=resize.nodes, base_rank=base,
                             group_rank=group_rank)
        log.info("generation %d: the group goes on in place at %d ranks on %d node(s)%s (%s)",
                 generation, resize.world_size, resize.nodes,
                 f", local ranks renumbered {renumbered}" if renumbered else "",
                 resize.reason)

    def leaving(self, reason: str, *, shrink: bool) -> None:
        """This node's ranks are about to stop for good (isolated, preempted; the
        launcher's signal handler calls this first). With ``shrink``, when the job can go
        on in place without them, the survivors re-form at the smaller world size and keep
        running; else they stop waiting for replacements at once and restart."""
        if self._left:
            return  # a second signal on the way out: the first one said it
        self._left = True
        plan = self._shrink_plan(reason) if shrink else "the whole job stops"
        if isinstance(plan, str):
            log.info("host %s leaves; the job cannot go on in place without it: %s",
                     self.node.host, plan)
            reason = f"{reason}; not in place: {plan}"
        if self.rdzv.mark_leaving(reason, plan if not isinstance(plan, str) else None):
            assert not isinstance(plan, str)
            generation = self.rdzv.generation() or self.node.generation + 1
            detail = (f"{reason}: the group re-forms in place at {plan.world_size} ranks, "
                      f"generation {generation}")
            log.info("host %s leaves: %s", self.node.host, detail)
            self.node.report_resized(min(plan.left), generation, plan.world_size, detail)

    def _shrink_plan(self, reason: str) -> groupstore.Resize | str:
        rnd = self.round
        if rnd is None or not self.group:
            return "no group is running here"
        if not self.in_place:
            return "in-place recovery is off for this agent (--no-in-place)"
        generation = self.rdzv.generation()
        if generation is None:
            return "the job store does not answer"
        self._follow(generation)  # an earlier change of the group first
        rnd = self.round
        assert rnd is not None
        blocker = inplace.resize_blocker(self.rdzv.in_place_keys(generation, rnd.world_size),
                                         leaving=[p.rank for p in self.group.values()])
        if blocker is not None:
            return blocker
        return groupstore.plan_shrink(
            rnd.world_size, rnd.group_world_size, [p.rank for p in self.group.values()],
            min_nodes=self.rdzv.plan.min_nodes, serves_store=rnd.group_rank == 0,
            reason=reason, node=rnd.group_rank)

    def _decide(self, failed: list[RankProc], initiated: list[RankProc]) -> inplace.Decision:
        assert self.round is not None
        generation = self.rdzv.generation() if self.in_place else None
        if generation is not None:
            self._follow(generation)
        single = self.in_place and len(failed) == 1 and not initiated \
            and self.remaining > 0 and generation is not None
        keys = self.rdzv.in_place_keys(generation, self.round.world_size) \
            if single and generation is not None else None
        return inplace.decide(enabled=self.in_place, failed=[p.rank for p in failed],
                              initiated=[p.rank for p in initiated],
                              restarts_left=self.remaining, generation=generation, keys=keys)

    def _recover_in_place(self, failed: list[RankProc], seen: float) -> bool:
        """A rank failed by itself (found at ``seen``): replace it in place if the group
        can take it (True), else say why (for the incident) and let the group restart
        (False)."""
        if not all(self.node.initiated_by(p.pid) for p in failed) \
                and (by := self.rdzv.group_restart_by()) is not None:
            # Another node's ranks were stopped for a command's group restart: ours failed
            # on their lost peers, and their exits are that command's.
            self.node.initiate_pids([p.pid for p in failed], by, keep=True)
        initiated = [p for p in failed if self.node.initiated_by(p.pid)]
        log.info("rank(s) exited: %s", ", ".join(f"{p.rank} (pid {p.pid}, exit "
                                                   f"{p.popen.returncode})" for p in failed))
        decision = self._decide(failed, initiated)
        if decision.in_place and self._replace_in_place(failed[0], self.node.generation,
                                                        seen=seen):
            return True
        if not initiated and self.node.ended_by is None:
            reason = decision.reason or "another agent replaced a rank at the same moment"
            for p in failed:
                self.node.report_fallback(p.rank, reason, self.round.world_size
                                          if self.round is not None else 0)
        return False

    def _replace_in_place(self, old: RankProc, known: int, *,
                          seen: float | None = None) -> RankProc | None:
        """Start ``old``'s replacement at the next generation, the others untouched. None
        when the generation did not rise by exactly one from ``known`` (another agent
        replaced a rank meanwhile: two failures, too many for in place). ``seen``: when
        the failure was found; the report says where the time went from there."""
        decided = time.time()
        generation = self.rdzv.bump_generation()
        if generation != known + 1:
            log.warning("generation rose from %d to %d meanwhile: two replacements at once, "
                        "restarting the group instead", known, generation)
            return None
        raised = time.time()
        # The exit first: the detector's crash evidence must not wait for the replacement.
        self.node.workers_exited({old.rank: self._failure(old)}, succeeded=False)
        self.remaining -= 1
        new = self._spawn(old.local_rank, old.rank, generation, self.restart_count, join=True)
        self._took_over(new, generation)
        phases = {"decision": decided - (seen or decided), "generation": raised - decided,
                  "spare": time.time() - raised}
        detail = (f"rank {old.rank} replaced in place on {self.node.host}: pid {old.pid} -> "
                  f"{new.pid} ({'warm spare' if new.warm else 'cold start'}), generation "
                  f"{generation}")
        log.info("%s (%s)", detail, ", ".join(f"{k} {v:.3f} s" for k, v in phases.items()))
        assert self.round is not None
        self.node.report_replaced(old.rank, generation, self.round.world_size, detail,
                                  phases={k: round(v, 4) for k, v in phases.items()})
        return new


def restart_stamps(ended: tuple[float, float, float], formed: float, *, warm: int,
                   ranks: int) -> timeline.RestartStamps:
    """The agent's side of a group restart for the ranks it starts (:mod:`..timeline`)."""
    seen, decided, stopped = ended
    return timeline.RestartStamps(seen=seen, decided=decided, stopped=stopped,
                                  formed=max(formed, stopped), warm=warm, ranks=ranks)


def error_message(path: str) -> str:
    """The message torch's ``@record`` wrote to the rank's error file, if any."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return ""
    message = data.get("message", "") if isinstance(data, Mapping) else ""
    if isinstance(message, Mapping):
        message = message.get("message", "")
    return str(message)
