"""Crash, unresponsive and hang: is every rank alive, and is the job making progress?

* ``crash``: a :class:`WorkerExit` that no command initiated, with a non-zero code or a
  signal, or with neither (the agent confirming the process is gone); or the agent
  reporting the rank as a zombie for a whole ``hb_timeout``. Names the rank and host.
* ``unresponsive``: heartbeat silence beyond ``hb_timeout``, by sender time. Alert only:
  silence alone is not proof of death (a partitioned network looks the same). One per
  host, widened as more of its ranks fall silent. Never judged during the grace after
  the detector's own (re)connect or takeover of the job, when it simply has not heard yet.
* ``hang``: no step completed for max(floor, ``hang_k`` x p99 step interval) while
  heartbeats go on. The floor is ``hang_floor`` (1 s) where the job shows what it waits
  for (every rank heard inside the stall, most of them in a collective: the ranks send a
  heartbeat as soon as a step runs long) on ranks it can name, else ``unclear_hang_floor``
  (5 s: too few steps learned, a rank not heard since, every rank busy in its own phase or
  waiting alike, the holder in an irregular phase (unless its process and loader workers
  did no work there for ``quiet_floor``: stuck, not refilling), in its phase for less than
  the floor (it moved inside the stall), on its first step or briefly in D/t;
  :meth:`Liveness.unclear`). A learned limit
  applies when most ranks are in a phase that is long by nature (checkpoint, eval), and a
  start-up grace before the first step. The
  culprits are the ranks whose phase differs from the majority (the one in ``data`` while
  the rest wait in ``comm``), else, when all wait in ``comm``, those behind in issued
  collectives. A rank the agent reports stopped (T) is a hang at once; one stuck in D is
  after ``dstate_grace``. One hang per job at a time; it resolves when progress resumes.

A host whose agent says its worker group is restarting (``NodeHeartbeat.restarting``) has
its ranks' silence explained: none of them is ``unresponsive``, no process state of theirs
is judged, and the job (a torchrun group restarts as a whole) has no hang, until the agent's
beat says the restart is over and the detector hears that host's ranks in the new attempt,
or for at most ``restart_timeout`` (a restart that takes longer is stuck, and judged).
Likewise a rank in the heartbeat phase ``recovering`` (its group re-forms in place around a
replacement) holds the hang judgement for at most ``recovery_timeout``; a crash whose rank
came back as a new process at the same attempt (replaced in place) is resolved.
"""

from __future__ import annotations

from typing import NamedTuple

from trainguard.contract.evidence import (
    CrashEvidence,
    HangEvidence,
    RankPhase,
    UnresponsiveEvidence,
)
from trainguard.contract.schemas import (
    GONE_STATES,
    RECOVERING_PHASE,
    STOPPED_STATES,
    NodeHeartbeat,
    WorkerExit,
    is_gone,
    is_stopped,
)

from .job import Census, JobState, RankInfo
from .thresholds import Thresholds

ODD_STATES = STOPPED_STATES | GONE_STATES
"""Process states the rules watch every tick (the others prove nothing either way)."""


class HangLimit(NamedTuple):
    """How long a stall may last, why, the floor under it, and why that floor is the
    unclear one ("" when the job showed what it waits for)."""

    limit: float
    basis: str
    floor: float
    unclear: str


def crash_key(rank: int, attempt: int) -> str:
    return f"crash:{rank}:{attempt}"


class Liveness:
    """The liveness rules of one job (stateless across jobs: all state is on the job)."""

    # -- crash --------------------------------------------------------------------------
    def on_exit(self, job: JobState, ex: WorkerExit, now: float) -> None:
        job.saw_generation(ex.host, ex.generation)
        if job.held_elsewhere(ex.rank, ex.host, ex.pid):
            return  # the number's previous process: its holder lives on
        r = job.admit(ex.rank, ex.attempt, ex.time or now, ex.host)
        if r is None:
            return  # an exit of an incarnation already replaced
        if not job.superseded(r, ex.pid, ex.time):
            job.closing.pop(r.rank, None)
            job.mark_exited(r)
        # else its replacement runs on: the old process's crash is still raised, and ends
        # at once (``replaced``)
        if ex.initiated_by:
            return  # a command or the launcher's teardown: expected, not a fault
        if ex.exit_code == 0 and not ex.signal:
            return
        if ex.time and now - ex.time > job.th.exit_max_age:
            return  # replayed history: state only
        self._crash(job, r, now, ex.time or now, CrashEvidence(
            source="worker_exit", exit_id=ex.id, exit_code=ex.exit_code, signal=ex.signal,
            error=ex.error, stderr_tail=ex.stderr_tail[-2000:], pid=ex.pid,
            local_rank=ex.local_rank, confirmed_gone=ex.exit_code is None and not ex.signal))

    def _crash(self, job: JobState, r: RankInfo, now: float, onset: float,
               evidence: CrashEvidence) -> None:
        evidence.last_step, evidence.phase, evidence.attempt = r.last_step, r.phase, r.attempt
        job.book.raise_(crash_key(r.rank, r.attempt), "crash", now=now, onset_at=onset,
                        ranks=[r.rank], hosts=[r.host],
                        step=r.last_step if r.last_step is not None else job.max_step,
                        severity="critical", evidence=evidence)

    # -- agent's process states -----------------------------------------------------------
    def on_node(self, job: JobState, node: NodeHeartbeat, now: float) -> None:
        job.saw_generation(node.host, node.generation)
        job.host_restarted(node.host, node.attempt, node.time)
        self._restart_mark(job, node)
        for rank, letter in node.ranks.items():
            if job.held_elsewhere(rank, node.host, node.pids.get(rank, 0)):
                continue  # an agent that has not caught up with a renumbering yet
            r = job.ranks.get(rank)
            if r is None:
                r = job.admit(rank, node.attempt, node.time, node.host)
                if r is None:
                    continue  # stale, or a gone rank an agent that has not caught up names
            elif job.superseded(r, node.pids.get(rank, 0), node.time):
                continue  # a beat taken before the rank's replacement spoke
            if letter != r.proc_state:
                if is_stopped(r.proc_state) and node.time > r.last_hb:
                    # Running again, as the agent saw: its silence so far is explained.
                    r.last_hb = node.time
                r.proc_state = letter
                r.proc_since = node.time
                if letter in ODD_STATES:
                    job.odd_procs.add(rank)
                else:
                    job.odd_procs.discard(rank)
        self.judge_process_states(job, now)

    @staticmethod
    def _restart_mark(job: JobState, node: NodeHeartbeat) -> None:
        """Note a host's restart, and its end once its ranks are heard in the new attempt."""
        if node.restarting:
            if node.restarting_since is not None:
                job.restarting[node.host] = node.restarting_since
            else:
                job.restarting.setdefault(node.host, node.time)
        elif node.host in job.restarting:
            ranks = [job.ranks.get(i) for i in node.ranks]
            if all(r is not None and r.attempt >= node.attempt for r in ranks):
                del job.restarting[node.host]

    @staticmethod
    def restarting_hosts(job: JobState, now: float) -> frozenset[str]:
        """Hosts whose restart explains their ranks' silence now (within ``restart_timeout``)."""
        if not job.restarting:
            return frozenset()
        limit = job.th.restart_timeout
        return frozenset(h for h, since in job.restarting.items() if now - since <= limit)

    def judge_process_states(self, job: JobState, now: float) -> None:
        if not job.odd_procs:
            return
        th = job.th
        excused = self.restarting_hosts(job, now)
        odd = [r for r in (job.ranks[i] for i in sorted(job.odd_procs))
               if job.current(r) and not r.exited and r.host not in excused]
        # T (SIGSTOP) lasts: a hang at once. t and D are often brief: only when they last.
        stopped = [r for r in odd if r.proc_state == "T"
                   or (is_stopped(r.proc_state) and now - r.proc_since >= th.dstate_grace)]
        if stopped:
            ranks = [r.rank for r in stopped]
            job.book.raise_("hang", "hang", now=now, onset_at=min(r.proc_since for r in stopped),
                            ranks=ranks, hosts=job.hosts_of(ranks), step=job.max_step,
                            severity="critical", evidence=HangEvidence(
                                culprits=ranks, culprit_basis="process_state",
                                process_states={str(r.rank): r.proc_state for r in stopped
                                                if r.proc_state is not None},
                                stalled_since=job.last_progress, dstate_grace=th.dstate_grace,
                                last_step=job.max_step))
        for r in odd:
            if is_gone(r.proc_state) and now - r.proc_since >= th.hb_timeout:
                job.mark_exited(r)
                self._crash(job, r, now, r.proc_since, CrashEvidence(
                    source="node_heartbeat", process_state=r.proc_state, confirmed_gone=True))

    # -- silence ------------------------------------------------------------------------
    def judge_silence(self, job: JobState, census: Census | None, now: float,
                      excused: frozenset[str] = frozenset()) -> None:
        th = job.th
        silent = census.silent if census is not None else [
            r for r in job.in_attempt()
            if r.proc_state not in ODD_STATES and job.is_silent(r, now)]
        by_host: dict[str, list[RankInfo]] = {}
        for r in silent:
            if r.host not in excused:
                by_host.setdefault(r.host or "-", []).append(r)
        for host, ranks in by_host.items():
            shown = ranks[:th.evidence_max_ranks]
            job.book.raise_(
                f"unresponsive:{host}", "unresponsive", now=now,
                onset_at=min(r.last_hb for r in ranks), ranks=[r.rank for r in ranks],
                hosts=[host] if host != "-" else [], step=job.max_step, severity="warning",
                evidence=UnresponsiveEvidence(
                    hb_timeout=th.hb_timeout,
                    last_heard={str(r.rank): r.last_hb for r in shown},
                    silent_for={str(r.rank): round(now - r.last_hb, 3) for r in shown},
                    last_step={str(r.rank): r.last_step for r in shown}))
        for key in job.book.keys("unresponsive:"):
            host = key.split(":", 1)[1]
            if host not in by_host and host not in excused:
                job.book.clear(key, now)

    # -- hang ---------------------------------------------------------------------------
    def hang_limit(self, job: JobState, census: Census | None = None,
                   culprits: list[int] | None = None) -> tuple[float, str]:
        """How long this stall may last, and why. Without a ``census``: the least it could
        be (when to look closer); with one, and the ranks holding the job up: what the job
        shows it waits for."""
        limit = self.judge_limit(job, census, culprits or [])
        return limit.limit, limit.basis

    def judge_limit(self, job: JobState, census: Census | None,
                    culprits: list[int]) -> HangLimit:
        th = job.th
        if not job.has_stepped:
            return HangLimit(th.startup_grace, "startup_grace", th.startup_grace, "")
        why = self.unclear(job, census, culprits)
        if self.first_step(job, culprits) is not None:
            # A process's first step (a replacement or a host taken back warming up, a
            # survivor's first on the new mesh of a grown or shrunk group, compiling) may
            # take as long as a job's: the same grace.
            return HangLimit(th.startup_grace, "startup_grace", th.startup_grace, why)
        floor, basis = ((max(th.unclear_hang_floor, th.hang_floor), "unclear_hang_floor")
                        if why else (th.hang_floor, "hang_floor"))
        p99 = job.p99_interval()
        limit = th.hang_k * p99 if p99 is not None else 0.0
        if limit > floor:
            basis = "p99"
        limit = max(limit, floor)
        if census is not None:
            held = self.held_in(job, census, culprits)
            long = ([census.majority] if census.majority in job.long_phases
                    else sorted(held & job.long_phases))
            if long:
                limit, phase = max((self.long_phase_limit(job, p, limit), p) for p in long)
                basis = f"phase:{phase}"
        return HangLimit(limit, basis, floor, why)

    def unclear(self, job: JobState, census: Census | None, culprits: list[int]) -> str:
        """Why the job does not show what it waits for ("" when it does): then the
        ``unclear_hang_floor`` applies. It shows it when the step intervals are learned,
        every live rank was heard inside the stall, most of them wait in a collective on
        ranks it can name, and these are neither in an irregular phase (unless stuck there,
        :meth:`stuck_in`), nor in their phase for less than ``hang_floor``, nor on their
        first step as this process (a replacement warming up, a first step compiling), nor
        briefly in D or t."""
        learned, need = len(job.intervals), job.th.hang_learn_steps
        if learned < need:
            return f"{learned} of {need} step intervals learned"
        if census is None:
            return ""
        if census.unheard:
            return f"{census.unheard} ranks not heard since the stall began"
        if 2 * census.waiting <= len(census.live):
            return f"{census.waiting} of {len(census.live)} ranks in a collective"
        if not culprits:  # all wait alike (every collective in flight): on whom is unclear
            return "no rank holds the others up"
        irregular = sorted(self.held_in(job, census, culprits) & job.irregular_phases)
        if irregular and not self.stuck_in(job, census, culprits):
            return f"held in {irregular[0]}"
        moved = self.moved_within(job, census, culprits)
        if moved is not None:
            return f"rank {moved.rank} in {moved.phase} for less than hang_floor"
        first = self.first_step(job, culprits)
        if first is not None:
            return f"rank {first} on its first step"
        brief = [r for r in census.stopped if r.proc_state != "T"
                 and census.time - r.proc_since < job.th.dstate_grace]
        if brief:  # D and t are often brief: they count once they last (``dstate_grace``)
            return f"rank {brief[0].rank} in {brief[0].proc_state} for less than dstate_grace"
        return ""

    @staticmethod
    def first_step(job: JobState, culprits: list[int]) -> int | None:
        """A rank holding the job up that has not completed a step as this process, or
        since its group went on at another size (:attr:`RankInfo.warming_up`)."""
        return next((i for i in culprits if i in job.ranks and job.ranks[i].warming_up),
                    None)

    @staticmethod
    def moved_within(job: JobState, census: Census, culprits: list[int]) -> RankInfo | None:
        """A rank holding the job up that entered its phase less than ``hang_floor`` ago: it
        moved inside the stall (out of a slow batch into ``compute``, say), so the stall says
        nothing yet of that phase; the fast floor waits until the phase itself lasts."""
        live = {r.rank for r in census.live}
        for i in culprits:
            r = job.ranks.get(i)
            if i in live and r is not None and r.phase_start is not None \
                    and census.time - r.phase_start < job.th.hang_floor:
                return r
        return None

    @staticmethod
    def stuck_in(job: JobState, census: Census, culprits: list[int]) -> bool:
        """Every rank holding the job up in an irregular phase did no work there for
        ``quiet_floor`` (its heartbeat says): a loader stuck, not refilling."""
        live = {r.rank for r in census.live}
        for i in culprits:
            r = job.ranks.get(i)
            if i not in live or r is None or (r.phase or "idle") not in job.irregular_phases:
                continue
            if r.quiet_since is None or r.last_hb - r.quiet_since < job.th.quiet_floor:
                return False
        return True

    @staticmethod
    def held_in(job: JobState, census: Census, culprits: list[int]) -> set[str]:
        """The phases the ranks holding the job up are in (a long or irregular one there
        takes its own, longer limit: one rank saving while the rest wait is no hang)."""
        live = {r.rank for r in census.live}
        return {job.ranks[i].phase or "idle" for i in culprits if i in live}

    def long_phase_limit(self, job: JobState, phase: str, base: float) -> float:
        samples = job.long_samples.get(phase)
        p99 = samples.quantile(0.99) if samples is not None else None
        if p99 is None:
            return max(base, job.th.long_phase_floor)
        return max(base, job.th.hang_k * p99)

    def tick(self, job: JobState, now: float) -> None:
        """Time-based judgement: silence, process states, hang; and hang resolution."""
        job.census = None
        self.resolve(job, now)
        if not job.ranks:
            return
        graced = now < job.judge_after
        if graced and not job.heard_all_since(job.grace_from):
            return  # not heard from every rank since the grace began: nothing is judged
        if not graced:
            self.judge_process_states(job, now)
        stalled_since = job.last_progress if job.has_stepped else job.attempt_start
        stalled = now - stalled_since
        base, _ = self.hang_limit(job)
        census = None
        if stalled > min(base, job.th.checkpoint_slow_floor):
            census = job.take_census(now, stalled_since)
        excused = self.restarting_hosts(job, now)
        if not graced:
            self.judge_silence(job, census, now, excused)
        if census is None or stalled <= base or not census.live or excused \
                or self.exit_pending(job, now) or self.recovering(census, now, job.th):
            return
        culprits = self.culprits(job, census)
        judged = self.judge_limit(job, census, culprits[0])
        if stalled > judged.limit:
            self._hang(job, census, now, stalled_since, judged, culprits)

    @staticmethod
    def recovering(census: Census, now: float, th: Thresholds) -> bool:
        """A rank re-forms its group in place (heartbeat phase ``recovering``, for at most
        ``recovery_timeout``): the stall is the recovery, not a hang."""
        return any(r.phase == RECOVERING_PHASE and r.phase_start is not None
                   and now - r.phase_start <= th.recovery_timeout for r in census.live)

    @staticmethod
    def exit_pending(job: JobState, now: float) -> bool:
        """A rank said it is closing and its exit is not reported yet (within ``exit_grace``):
        the others wait for it, and its exit, not their wait, says what happened."""
        if not job.closing:
            return False
        grace = job.th.exit_grace
        for rank in [k for k, t in job.closing.items() if now - t > grace]:
            del job.closing[rank]
        return bool(job.closing)

    def _hang(self, job: JobState, census: Census, now: float, since: float,
              judged: HangLimit, named_by: tuple[list[int], str]) -> None:
        culprits, how = named_by
        named = culprits or [r.rank for r in census.live]
        cap = job.th.evidence_max_ranks
        everyone = census.live + census.silent + census.stopped
        first = set(culprits)
        detail = sorted(everyone, key=lambda r: (r.rank not in first, r.rank))[:cap]
        state = {r.rank: "silent" for r in census.silent}
        state.update((r.rank, "stopped") for r in census.stopped)
        evidence = HangEvidence(
            stalled_since=since, stalled_for=round(now - since, 3), limit=judged.limit,
            limit_basis=judged.basis, p99_step_interval=job.p99_interval(),
            hang_floor=judged.floor, hang_k=job.th.hang_k, unclear=judged.unclear,
            last_step=job.max_step, majority_phase=census.majority,
            phase_counts=census.counts, silent=[r.rank for r in census.silent][:cap],
            culprits=culprits[:cap], culprit_basis=how,
            phases={str(r.rank): self._describe(r, state.get(r.rank, "alive"), now)
                    for r in detail},
            truncated=len(everyone) > cap)
        job.book.raise_("hang", "hang", now=now, onset_at=since, ranks=named,
                        hosts=job.hosts_of(named), step=job.max_step, severity="critical",
                        evidence=evidence, widen=False)

    @staticmethod
    def _describe(r: RankInfo, state: str, now: float) -> RankPhase:
        return RankPhase(
            phase=r.phase or "idle",
            elapsed=round(now - r.phase_start, 3) if r.phase_start is not None else None,
            host=r.host, step=r.hb_step, coll_seq=r.coll_seq, state=state,
            process_state=r.proc_state,
            quiet_for=round(r.last_hb - r.quiet_since, 3) if r.quiet_since is not None else None)

    @staticmethod
    def culprits(job: JobState, census: Census) -> tuple[list[int], str]:
        """Who is holding the job up, and on what basis (see the module docstring)."""
        named = sorted(r.rank for r in census.stopped)
        if named:
            return named + sorted(r.rank for r in census.silent), "process_state"
        differ = sorted(r.rank for r in census.live if (r.phase or "idle") != census.majority)
        silent = sorted(r.rank for r in census.silent)
        if differ or silent:
            return sorted(differ + silent), "phase" if differ else "silent"
        if census.majority in job.comm_phases and census.live:
            low = min(r.coll_seq for r in census.live)
            behind = sorted(r.rank for r in census.live if r.coll_seq == low)
            if len(behind) < len(census.live):
                return behind, "coll_seq"
        return [], "none"

    def resolve(self, job: JobState, now: float) -> None:
        """Close hangs the job has moved past, and crashes of ranks that came back."""
        hang = job.book.get("hang")
        if hang is not None and isinstance(hang.evidence, HangEvidence):
            since = hang.evidence.stalled_since
            moved = since is not None and job.last_progress > since
            stuck = any(is_stopped(job.ranks[i].proc_state)
                        and job.current(job.ranks[i]) for i in job.odd_procs)
            if moved and not stuck:
                job.book.clear("hang", now, resumed_at=job.last_progress,
                               resumed_step=job.max_step)
        for key in job.book.keys("crash:"):
            _, rank, attempt = key.split(":")
            r = job.ranks.get(int(rank))
            if r is not None and (r.attempt > int(attempt) or self.replaced(job, key, r)):
                job.book.clear(key, now, restarted_attempt=r.attempt)

    @staticmethod
    def replaced(job: JobState, key: str, r: RankInfo) -> bool:
        """The crashed rank runs again as another process at the same attempt: replaced in
        place (its survivors, and so the attempt, carried on)."""
        crash = job.book.get(key)
        evidence = crash.evidence if crash is not None else None
        return isinstance(evidence, CrashEvidence) and bool(evidence.pid) and r.heard \
            and not r.exited and r.pid not in (0, evidence.pid)
