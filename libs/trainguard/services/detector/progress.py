"""``progress:<job>``: the once-a-second summary of a job, and starting again from one.

The remediator (incident resolution), the coordinator (``at_step`` choices, save-now) and
``trainguard status`` read this instead of raw telemetry, so it says what they need: the
newest step of the current attempt, the slowest live rank's step, the typical step time,
and each rank's state. A detector that takes a job over seeds itself from the last one.
"""

from __future__ import annotations

from trainguard.contract.schemas import is_stopped
from trainguard.runtime.state import Progress, RankProgress, RankState

from .job import JobState, RankInfo


def rank_state(job: JobState, r: RankInfo, now: float, hung: set[int]) -> RankState:
    """One word for a rank, most telling first: exited, stopped, hung, silent, slow, ok."""
    if r.exited or not job.current(r):
        return "exited"
    if is_stopped(r.proc_state):
        return "stopped"
    if r.rank in hung:
        return "hung"
    if job.is_silent(r, now):
        return "silent"
    return "slow" if r.straggling else "ok"


def summarize(job: JobState, now: float) -> Progress:
    """The job as other services should see it now (O(ranks): once a second)."""
    hang = job.book.get("hang")
    hung = set(hang.ranks) if hang is not None else set()
    ranks: dict[int, RankProgress] = {}
    live_steps: list[int] = []
    for r in job.ranks.values():
        state = rank_state(job, r, now, hung)
        ranks[r.rank] = RankProgress(
            rank=r.rank, host=r.host, step=r.last_step, phase=r.phase,
            phase_elapsed=max(0.0, now - r.phase_start) if r.phase_start else 0.0,
            state=state, process_state=r.proc_state, last_seen=r.last_hb,
            attempt=r.attempt)
        if state != "exited" and r.last_step is not None:
            live_steps.append(r.last_step)
    return Progress(job=job.name, time=now,
                    world_size=max(job.world_size, job.active_count),
                    incarnation=job.incarnation, generation=job.generation,
                    last_step=job.max_step,
                    min_step=min(live_steps) if live_steps else None,
                    median_step_time=job.intervals.median(), ranks=ranks)


def seed(job: JobState, progress: Progress, now: float) -> None:
    """Start from a previous owner's summary: attempt, hosts, steps, typical step time.

    The clock of "no progress since" starts now: this detector saw nothing before.
    """
    # The job-wide attempt goes on from the previous owner's, so it never moves backwards
    # for the remediator (a restart is a higher one); ranks bring their own.
    job.incarnation = max(job.incarnation, progress.incarnation)
    job.seeded_generation = max(job.seeded_generation, progress.generation)
    job.set_world(max(job.world_size, progress.world_size))
    for rp in progress.ranks.values():
        if rp.rank not in job.ranks:
            r = job.admit(rp.rank, rp.attempt, now, rp.host)
            if r is None:
                continue
            if rp.last_seen:
                r.last_hb, r.heard = rp.last_seen, True  # silent since then, if it still is
            if rp.state == "exited":
                job.mark_exited(r)
    if progress.last_step is not None and job.max_step is None:
        job.max_step = progress.last_step
        job.has_stepped = True
    if progress.median_step_time and not len(job.intervals):
        job.intervals.add(progress.median_step_time)
