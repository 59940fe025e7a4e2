"""Per-job state the rules judge: ranks, attempts, progress, and steps assembled from reports.

Everything here is updated per message, so it is written for the hot path: slotted
classes, no allocation beyond what a step needs, O(1) per heartbeat or step report. Work
that is O(ranks) (medians across ranks, the census of phases) happens once per step when
a step's reports are complete (:class:`StepBucket`), or once per tick.

Time is the sender's: a client that reconnects delivers buffered messages late, and
judging by arrival would invent hangs and recoveries. An incarnation of a rank is its
``attempt``: a higher one resets that rank's windows (steps go backwards after a restart),
a lower one is a late message from a process that is gone and is dropped.

Attempts are torchrun's restart counts, and each node's agent keeps its own: a node whose
group restarts for a membership change does not count it, so after a few faults node-a may
be at attempt 10 while node-b is at 7, both in one healthy worker group. So attempts are
compared per host only (:meth:`JobState.current`), and a rise on any host re-forms the job
(:attr:`JobState.incarnation`).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter, deque
from collections.abc import Callable
from typing import Protocol

from trainguard.contract.evidence import BatchFault
from trainguard.contract.schemas import (
    GONE_STATES,
    RECOVERING_PHASE,
    STOPPED_STATES,
    Heartbeat,
    ProcessState,
    StepReport,
)

from .book import AnomalyBook
from .thresholds import Thresholds
from .windows import FlagHistory, Ring

CLOSED_PHASES = frozenset({"closed", "exited", "done"})
"""A heartbeat in one of these phases says the rank is shutting down on purpose."""


class RankInfo:
    """What the detector knows about one rank of the job."""

    __slots__ = ("attempt", "coll_done", "coll_seq", "compute_recent", "exited", "formed_at",
                 "hb_step", "heard", "host", "last_hb", "last_step", "local_rank", "phase",
                 "phase_start", "pid", "proc_since", "proc_state", "quiet_since", "rank",
                 "stepped_at", "straggle", "straggle_since", "straggling")

    def __init__(self, rank: int, attempt: int, t: float, host: str, window: int) -> None:
        self.rank = rank
        self.host = host
        self.local_rank: int | None = None
        self.straggle = FlagHistory(window)
        self.compute_recent: deque[float] = deque(maxlen=window)
        self.straggling = False
        self.proc_state: ProcessState | None = None
        self.proc_since = t
        self.pid = 0
        self.reset(attempt, t)

    def reset(self, attempt: int, t: float) -> None:
        """A new incarnation: everything learned about the old process is void."""
        self.attempt = attempt
        self.last_hb = t
        self.heard = False
        """Has this incarnation sent telemetry? Until then it is starting (startup grace)."""
        self.phase: str | None = None
        self.phase_start: float | None = None
        self.quiet_since: float | None = None
        """Since when its phase has shown no work, as its newest heartbeat says."""
        self.hb_step: int | None = None
        self.coll_seq = 0
        self.coll_done = 0
        self.last_step: int | None = None
        self.formed_at = t
        """When the group last formed around this process (its start, or its hello at a
        new size): the first step after it may compile anew (a new mesh)."""
        self.stepped_at: float | None = None
        """When it last completed a step (the report's time)."""
        self.exited = False
        self.straggle.clear()
        self.straggle_since: float | None = None
        self.compute_recent.clear()

    @property
    def warming_up(self) -> bool:
        """No step completed since the group formed around this process."""
        return self.stepped_at is None or self.stepped_at <= self.formed_at


class StepBucket:
    """The reports of one step from every rank, judged together once complete."""

    __slots__ = ("batch_faults", "compute", "count", "data", "durations", "first_time",
                 "grad_origins", "grads", "index", "long", "losses", "lr", "nonfinite",
                 "skipped", "spikes", "step", "work", "world")

    def __init__(self, step: int, first_time: float, index: int) -> None:
        self.step = step
        self.first_time = first_time
        self.index = index
        """How many steps into the attempt this one is (warm-up exclusion)."""
        self.count = 0
        self.compute: dict[int, float] = {}
        self.data: dict[int, float] = {}
        self.durations: list[float] = []
        self.losses: dict[int, float] = {}
        self.grads: dict[int, float] = {}
        self.nonfinite: list[int] = []
        self.grad_origins: dict[int, StepReport] = {}
        """Reports that named where their non-finite gradients started, by rank."""
        self.spikes: dict[int, dict[str, float]] = {}
        """The largest parameter gradients of ranks whose norm spiked, by rank."""
        self.work: list[float] = []
        self.long: dict[str, float] = {}
        self.world = 0
        """The world size the ranks report for this step (0: not told)."""
        self.lr: float | None = None
        """The learning rate the ranks report for this step (None: not told)."""
        self.batch_faults: dict[int, BatchFault] = {}
        """What the ranks' batch checks found wrong with their batches, by rank."""
        self.skipped = False
        """The ranks skipped the step (a bad batch) and made no update."""


@dataclasses.dataclass(slots=True)
class Census:
    """Where every rank of the current attempt is, at one tick (computed only when needed)."""

    time: float
    majority: str
    counts: dict[str, int]
    live: list[RankInfo]
    silent: list[RankInfo]
    stopped: list[RankInfo]
    waiting: int = 0
    """Live ranks in a collective (a comm phase, or collectives issued and not done)."""
    unheard: int = 0
    """Live ranks whose newest heartbeat is older than the census's ``since``."""


class StepRule(Protocol):
    def on_step(self, job: JobState, bucket: StepBucket, now: float) -> None: ...


class JobState:
    """One job: its ranks, the current attempt, step progress and the open anomalies."""

    def __init__(self, name: str, th: Thresholds, book: AnomalyBook,
                 clock: Callable[[], float]) -> None:
        now = clock()
        self.name = name
        self.clock = clock
        """Detector time, read once per judged step (never per message)."""
        self.book = book
        self.ranks: dict[int, RankInfo] = {}
        self.step_rules: list[StepRule] = []
        self.world_size = 0
        self.world_incarnation = -1
        self.world_time = 0.0
        """Sender time of the newest hello that declared the world size."""
        self.recovering_since = 0.0
        """Sender time of the newest heartbeat that entered the in-place recovery phase."""
        self.host_attempt: dict[str, int] = {}
        """The newest attempt of each host's ranks (attempts of different hosts are not
        comparable: each node's torchrun counts its own restarts)."""
        self.incarnation = -1  # the first group, made below, is incarnation 0
        """How often the job started over (any host's attempt rose, or a rollback): the
        job-wide attempt that ``progress:<job>`` publishes, kept across detectors by
        :func:`.progress.seed`. Not the launcher's process-group generation."""
        self.host_generation: dict[str, int] = {}
        """The newest process-group generation each host's agent and ranks reported since
        its launcher started (the launcher's, job-wide: every host draws it from the
        rendezvous), see :attr:`generation`."""
        self.seeded_generation = 0
        """The previous owner's :attr:`generation`, until a host reports one."""
        self.active_count = 0
        self.exited_count = 0
        self.expected = 1
        self.judge_after = now
        """No silence or hang judgement before this (reconnect or takeover grace), except
        a hang once every rank has been heard since :attr:`grace_from`."""
        self.grace_from = now
        """When the last grace began: the detector's view of the job is current again once
        every rank of the attempt has been heard since (:meth:`heard_all_since`)."""
        self.rejected_overrides: list[str] = []
        self.census: Census | None = None
        self.pending_long: list[tuple[str, float, int, float]] = []
        self.restarting: dict[str, float] = {}
        """Hosts whose agent reports its worker group restarting -> since when (agent's
        clock): see :mod:`.liveness`."""
        self.closing: dict[int, float] = {}
        """Ranks that said they are closing (sender time) and whose exit has not been
        reported yet: see ``exit_grace``."""
        self.odd_procs: set[int] = set()
        """Ranks the agent reports stopped or gone (``STOPPED_STATES``, ``GONE_STATES``):
        checked every tick, others never."""
        self.configure(th)
        self._new_attempt(0, now)
        self.attempt_start = now

    # -- configuration ----------------------------------------------------------------
    def configure(self, th: Thresholds) -> None:
        """Apply thresholds (process defaults, or a job's own overrides from its hello)."""
        self.th = th
        self.long_phases = th.phase_set("long_phases")
        self.comm_phases = th.phase_set("comm_phases")
        self.irregular_phases = th.phase_set("irregular_phases")
        self._not_compute = tuple(self.comm_phases | self.long_phases)
        self._data_phase = th.data_phase
        self.intervals = Ring(th.hang_window)
        self.long_samples: dict[str, Ring] = {p: Ring(256) for p in self.long_phases}
        for r in self.ranks.values():
            r.straggle = FlagHistory(th.straggler_window)
            r.compute_recent = deque(maxlen=th.straggler_window)

    @property
    def generation(self) -> int:
        """The job's current process-group generation (0: unknown), published in
        ``progress:<job>`` so the remediator numbers its restarts as the agents number
        their exits. The newest of its hosts' launchers: a job launched again starts a new
        rendezvous, whose generations start over."""
        return max(self.host_generation.values(), default=self.seeded_generation)

    def saw_generation(self, host: str, generation: int) -> None:
        """``host``'s agent or rank reported ``generation`` (it only rises while its
        launcher runs: an exit of the older group, arriving late, takes nothing back)."""
        if host and generation > self.host_generation.get(host, 0):
            self.host_generation[host] = generation

    def launcher_changed(self, host: str) -> None:
        """``host``'s launcher started, or left: what it reported before is void."""
        self.host_generation.pop(host, None)

    def admit_attempt(self, attempt: int, t: float) -> None:
        """The job moved on to ``attempt`` (known from a summary before any rank says so)."""
        if attempt > self.attempt:
            self._new_attempt(attempt, t)
            self.recount()

    def rolled_back(self, t: float) -> None:
        """The ranks went back to an earlier step without a new process (a ``reload``):
        a new incarnation of the job, at the same attempt."""
        self._new_attempt(self.attempt, t)

    def _new_attempt(self, attempt: int, t: float) -> None:
        self.incarnation += 1
        self.attempt = attempt
        self.attempt_start = t
        self.has_stepped = False
        self.steps_seen = 0
        self.max_step: int | None = None
        self.max_step_time = t
        self.max_hb_step: int | None = None
        self.last_progress = t
        self.buckets: dict[int, StepBucket] = {}
        self.closed_upto = -(2**62)

    # -- ranks and attempts -------------------------------------------------------------
    def admit(self, rank: int, attempt: int, t: float, host: str = "",
              world: int = 0) -> RankInfo | None:
        """The rank's state for a message of ``attempt`` sent at ``t``; None if the message
        is stale. A rank outside the world the current group declared is new only by a
        message that itself declares a world holding it (``world``), newer than that
        declaration (a grow); any other is about a number that went, such as a renumbered
        process's beat as its old rank, taken before the renumbering and heard after it."""
        r = self.ranks.get(rank)
        if r is None:
            if self.beyond_world(rank) and not (rank < world and t >= self.world_time):
                return None
            r = self.ranks[rank] = RankInfo(rank, attempt, t, host, self.th.straggler_window)
            self._joined(r, t)
        elif attempt != r.attempt:
            if attempt < r.attempt:
                return None
            self._left(r)
            r.reset(attempt, t)
            r.proc_state = None  # a new process: the agent's next beat says how it is
            self.odd_procs.discard(rank)
            self.closing.pop(rank, None)
            self._joined(r, t)
        if host and r.host != host:
            self._left(r)
            r.host = host
            self._joined(r, t)
        return r

    def host_restarted(self, host: str, attempt: int, t: float) -> None:
        """The host's agent says its worker group is at a later ``attempt`` (it restarted
        the group): the job re-formed, even before any new rank speaks, so an incident
        waiting for the launcher's restart sees it now rather than after the ranks' start."""
        newest = self.host_attempt.get(host)
        if newest is not None and attempt > newest:
            self.host_attempt[host] = attempt
            self._new_attempt(max(self.attempt, attempt), t)
            self.recount()

    def current(self, r: RankInfo) -> bool:
        """Whether ``r`` is of its host's newest attempt (the job's current worker group)."""
        return r.attempt >= self.host_attempt.get(r.host, r.attempt)

    # The counts behind ``expected`` are kept incrementally: a full recount is O(ranks), and
    # doing one per newly seen rank, or host, would make the start of a 10,000-rank job
    # quadratic (16,384 ranks on 2,048 hosts: 3.5 s of a taking-over detector's loop).
    def _joined(self, r: RankInfo, t: float) -> None:
        newest = self.host_attempt.get(r.host)
        if newest is not None and r.attempt > newest:
            # A restart on that host: the whole group re-formed (steps start over).
            self.host_attempt[r.host] = r.attempt
            self._new_attempt(max(self.attempt, r.attempt), t)
            self.recount()
            return
        if newest is None:
            # A host seen for the first time: this rank is its only one, nobody else's
            # standing changes.
            self.host_attempt[r.host] = r.attempt
            self.attempt = max(self.attempt, r.attempt)
        elif r.attempt < newest:
            return
        if r.exited:
            self.exited_count += 1
        else:
            self.active_count += 1
        self._expect()

    def _left(self, r: RankInfo) -> None:
        if self.current(r):
            if r.exited:
                self.exited_count -= 1
            else:
                self.active_count -= 1

    def mark_exited(self, r: RankInfo) -> None:
        """The rank's process is gone (an exit, a clean close): no longer expected."""
        if not r.exited:
            self._left(r)
            r.exited = True
            self._joined(r, r.last_hb)

    def revive(self, r: RankInfo, t: float) -> None:
        """A new process under the same attempt (it said hello again)."""
        self.closing.pop(r.rank, None)
        self._left(r)
        r.reset(r.attempt, t)
        self._joined(r, t)

    def recount(self) -> None:
        """Recount the ranks of the current attempt (O(ranks): on attempt changes only)."""
        here = [r for r in self.ranks.values() if self.current(r)]
        self.exited_count = sum(1 for r in here if r.exited)
        self.active_count = len(here) - self.exited_count
        self._expect()

    def _expect(self) -> None:
        """Ranks expected to report each step of the current attempt."""
        declared = (self.world_size - self.exited_count
                    if self.world_incarnation == self.incarnation else 0)
        self.expected = max(self.active_count, declared, 1)

    def set_world(self, size: int, at: float | None = None) -> None:
        """The world size the current worker group declared at ``at`` (its ranks' hellos,
        sender time). A smaller one than before: the ranks at or above it are gone (a host
        left and the group went on without it, closing up the gap), not silent; a hello
        older than the declaration it would shrink is late history and changes nothing."""
        if at is not None:
            if 0 < size < self.world_size and at < self.world_time:
                return
            self.world_time = max(self.world_time, at)
        gone = [rank for rank in self.ranks if rank >= size] if 0 < size < self.world_size \
            else []
        for rank in gone:
            del self.ranks[rank]
            self.odd_procs.discard(rank)
            self.closing.pop(rank, None)
        self.world_size = size
        self.world_incarnation = self.incarnation
        if gone:
            self.recount()
        else:
            self._expect()

    def held_elsewhere(self, rank: int, host: str, pid: int) -> bool:
        """``rank``'s number is held by a live process on another host than ``host``'s
        ``pid``: a report about the process that had the number before (a host that left in
        place and whose later ranks closed up the gap), not about its holder."""
        r = self.ranks.get(rank)
        return (r is not None and not r.exited and bool(r.host and host and r.pid and pid)
                and r.host != host and r.pid != pid)

    @staticmethod
    def superseded(r: RankInfo, pid: int, t: float) -> bool:
        """A report at ``t`` about ``pid`` concerns a process that held ``r``'s number before
        its current holder, which has spoken since (an in-place replacement's first beat
        can overtake the agent's report of the old process's exit: two subjects, no order
        between them). The agent and its ranks share a host, and so a clock."""
        return bool(pid and r.pid and pid != r.pid and r.heard and t and t < r.last_hb)

    def beyond_world(self, rank: int) -> bool:
        """``rank`` is outside the world the current group declared (an agent that has not
        caught up with a shrink yet still names it): not a rank to admit."""
        return 0 < self.world_size <= rank and self.world_incarnation == self.incarnation

    def heard_all_since(self, t: float) -> bool:
        """Every live rank of the attempt sent a heartbeat at or after ``t`` (O(ranks))."""
        return all(r.last_hb >= t and r.heard for r in self.in_attempt())

    def in_attempt(self) -> list[RankInfo]:
        return [r for r in self.ranks.values() if self.current(r) and not r.exited]

    def last_heard(self) -> float:
        """Sender time of the newest heartbeat from any rank (idle detection; O(ranks))."""
        return max((r.last_hb for r in self.ranks.values()), default=self.attempt_start)

    def hosts_of(self, ranks: list[int]) -> list[str]:
        return sorted({self.ranks[r].host for r in ranks if r in self.ranks
                       and self.ranks[r].host})

    def _progress(self, t: float) -> None:
        self.has_stepped = True
        if t > self.last_progress:
            self.last_progress = t

    def _long_sample(self, phase: str, seconds: float, rank: int, t: float) -> None:
        if seconds > 0.0:
            self.long_samples[phase].add(seconds)
            self.pending_long.append((phase, seconds, rank, t))

    # -- telemetry (hot path) -----------------------------------------------------------
    def on_heartbeat(self, hb: Heartbeat) -> None:
        r = self.ranks.get(hb.rank)
        if r is None or hb.attempt != r.attempt or (hb.host and hb.host != r.host):
            r = self.admit(hb.rank, hb.attempt, hb.time, hb.host)
            if r is None:
                return
        t = hb.time
        if t < r.last_hb:
            return
        if hb.pid and hb.pid != r.pid:
            if r.pid and r.heard:
                # A new process under the same attempt: torchrun restarted this host's group
                # for a membership change, which its restart count does not count.
                self.revive(r, t)
            r.pid = hb.pid
        r.last_hb = t
        r.heard = True
        phase = hb.phase
        started = t - hb.phase_elapsed
        if phase != r.phase:
            old = r.phase
            if old is not None and old in self.long_phases and r.phase_start is not None:
                self._long_sample(old, started - r.phase_start, r.rank, t)
            r.phase = phase
            if phase == RECOVERING_PHASE:
                self.recovering_since = max(self.recovering_since, t)
            if phase in CLOSED_PHASES:
                if not r.exited:
                    self.closing[r.rank] = t
                self.mark_exited(r)
        r.phase_start = started
        r.quiet_since = t - hb.quiet_for if hb.quiet_for > 0 else None
        step = hb.step
        if step is not None and (r.hb_step is None or step > r.hb_step):
            r.hb_step = step
            if self.max_hb_step is None or step > self.max_hb_step:
                # Entering step s proves step s - 1 completed: progress only if the step
                # reports have not already told us (they may be late or lost).
                if self.max_hb_step is not None and (self.max_step is None
                                                     or step - 1 > self.max_step):
                    self._progress(t)
                self.max_hb_step = step
        r.coll_seq = hb.coll_seq
        r.coll_done = hb.coll_done

    def on_step(self, sr: StepReport) -> None:
        r = self.ranks.get(sr.rank)
        if r is None or sr.attempt != r.attempt:
            r = self.admit(sr.rank, sr.attempt, sr.time, world=sr.world_size)
            if r is None:
                return
        t = sr.time
        step = sr.step
        if r.last_step is not None and step < r.last_step:
            # The same process went back: a rollback in place (every rank reloaded a
            # checkpoint in-process). The job's steps start over like after a resume, and
            # so do the baselines judged per generation.
            r.last_step, r.hb_step = step, None
            if step <= self.closed_upto or (self.max_step is not None and step < self.max_step):
                self.rolled_back(t)
        if r.last_step is None or step > r.last_step:
            r.last_step = step
        if r.stepped_at is None or t > r.stepped_at:
            r.stepped_at = t
        if self.max_step is None or step > self.max_step:
            if self.max_step is not None:
                self.steps_seen += 1
                if self.steps_seen > self.th.warmup_steps and t > self.max_step_time \
                        and self.recovering_since <= self.max_step_time:
                    # A gap that held an in-place recovery is not a step interval: it would
                    # raise the hang limit (hang_k x p99) for the next hang_window steps.
                    self.intervals.add((t - self.max_step_time) / (step - self.max_step))
            self.max_step = step
            self.max_step_time = t
            self._progress(t)
        if step <= self.closed_upto:
            return
        b = self.buckets.get(step)
        if b is None:
            b = self.buckets[step] = StepBucket(step, t, self.steps_seen)
        # A report covering several steps (the client's report_every) carries per-step
        # means of duration and phases, and totals of tokens and samples.
        n = sr.steps if sr.steps > 1 else 1
        phases = sr.phases
        total = sr.duration if sr.duration > 0.0 else sum(phases.values())
        excluded = 0.0
        if phases:
            for p in self._not_compute:
                v = phases.get(p)
                if v:
                    excluded += v
                    if p in self.long_phases:
                        b.long[p] = max(b.long.get(p, 0.0), v)
                        self._long_sample(p, v, r.rank, t)
            data = phases.get(self._data_phase)
            if data is not None:
                b.data[r.rank] = data
        rank = r.rank
        b.count += 1
        b.compute[rank] = total - excluded
        duration = total
        b.durations.append(duration)
        loss = sr.loss
        grad = sr.grad_norm
        bad = sr.nonfinite > 0
        if loss is not None:
            b.losses[rank] = loss
            bad = bad or not math.isfinite(loss)
        if grad is not None:
            b.grads[rank] = grad
            bad = bad or not math.isfinite(grad)
        if bad:
            b.nonfinite.append(rank)
            if sr.nonfinite_params:
                b.grad_origins[rank] = sr
        if sr.spike_params:
            b.spikes[rank] = sr.spike_params
        if sr.world_size:
            b.world = sr.world_size
        if sr.lr is not None:
            b.lr = sr.lr
        if sr.batch_fault is not None:
            b.batch_faults[rank] = sr.batch_fault
        if sr.skipped:
            b.skipped = True
        work = sr.tokens if sr.tokens is not None else sr.samples
        if duration > 0.0:
            b.work.append((work / n if work is not None else 1.0) / duration)
        if b.count >= self.expected:
            self.close_through(step, self.clock())

    # -- steps ------------------------------------------------------------------------
    def close_through(self, step: int, now: float) -> None:
        """Judge every open step up to ``step``, oldest first (rules assume order)."""
        for s in sorted(k for k in self.buckets if k <= step):
            bucket = self.buckets.pop(s)
            self.closed_upto = s
            for rule in self.step_rules:
                rule.on_step(self, bucket, now)

    def close_due(self, now: float) -> None:
        """Close steps that will not complete: a later step is well on, or they timed out."""
        if not self.buckets:
            return
        newest = max(self.buckets)
        due = [s for s, b in self.buckets.items()
               if s <= newest - 2 or now - b.first_time > self.th.bucket_timeout]
        if due:
            self.close_through(max(due), now)

    # -- ticks --------------------------------------------------------------------------
    def is_silent(self, r: RankInfo, now: float) -> bool:
        """No heartbeat for ``hb_timeout``; a rank only announced (by its hello or its
        agent) but not heard from yet is starting, and gets the ``startup_grace``."""
        return now - r.last_hb > (self.th.hb_timeout if r.heard else self.th.startup_grace)

    def p99_interval(self) -> float | None:
        return self.intervals.quantile(0.99)

    def take_census(self, now: float, since: float | None = None) -> Census:
        """Phase of every rank of the attempt; silent and stopped ranks apart (O(ranks)).

        ``since``: the start of a stall; live ranks not heard since are counted apart (their
        phase is from before it, and says nothing about what the job waits for)."""
        live: list[RankInfo] = []
        silent: list[RankInfo] = []
        stopped: list[RankInfo] = []
        counts: Counter[str] = Counter()
        in_comm = unheard = 0
        comm = self.comm_phases
        for r in self.in_attempt():
            if r.proc_state in STOPPED_STATES:
                stopped.append(r)
            elif r.proc_state in GONE_STATES:
                continue  # dying: the crash rule judges it, silence proves nothing more
            elif self.is_silent(r, now):
                silent.append(r)
            else:
                live.append(r)
                counts[r.phase or "idle"] += 1
                if r.phase in comm or r.coll_seq > r.coll_done:
                    in_comm += 1
                if since is not None and r.last_hb < since:
                    unheard += 1
        majority = "idle"
        if counts:
            top = max(counts.values())
            tied = sorted(p for p, n in counts.items() if n == top)
            waiting = [p for p in tied if p in self.comm_phases]
            majority = waiting[0] if waiting else tied[0]
        self.census = Census(now, majority, dict(counts), live, silent, stopped, in_comm,
                             unheard)
        return self.census
