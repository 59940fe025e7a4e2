"""Hangs judged from what the job shows: a second on short steps, never on irregular ones.

Simulated time (pure detector, no bus): 50 ms steps, the client's early heartbeat modelled
by :class:`~trainguard.services.detector.synthetic.SimJob`.
"""

from __future__ import annotations

import pytest

from trainguard.contract.schemas import Attempt, RankHello
from trainguard.services.detector.synthetic import Harness, SimConfig
from trainguard.services.detector.thresholds import Thresholds

SHORT = {"compute": 0.04, "data": 0.004, "comm": 0.004, "jitter": 0.15}
"""A job of ~50 ms steps."""


def short_job(ranks: int = 8, th: Thresholds | None = None, **cfg: object) -> Harness:
    config = SimConfig(ranks=ranks, ranks_per_host=4, **{**SHORT, **cfg})  # type: ignore[arg-type]
    return Harness(th or Thresholds(), config, tick_every=0.25)


def stall_until_hang(h: Harness, culprit: int, phase: str, most: float = 12.0,
                     quiet: bool = False) -> float:
    """Rank ``culprit`` stops in ``phase``, the rest wait in ``comm``; seconds to the hang.
    ``quiet``: the culprit does no work there (a loader stuck, not refilling)."""
    onset = h.sim.now
    h.sim.stall(most, lambda r: phase if r == culprit else "comm",
                frozenset({culprit}) if quiet else frozenset())
    [hang] = h.opened("hang")
    assert hang.ranks == [culprit] and hang.evidence.culprits == [culprit]
    return hang.detected_at - onset


def test_a_hang_in_a_job_of_50_ms_steps_is_found_with_its_culprit_within_a_second_and_a_half(
        ) -> None:
    h = short_job()
    h.sim.steps(300)
    found = stall_until_hang(h, 3, "compute")
    [hang] = h.opened("hang")
    assert hang.evidence.limit_basis == "hang_floor" and hang.evidence.limit == 1.0
    assert hang.evidence.majority_phase == "comm" and hang.evidence.culprit_basis == "phase"
    assert found <= 1.5


def test_a_rank_held_in_an_irregular_phase_gets_the_unclear_floor() -> None:
    """One rank in ``data`` for 2 s while the rest wait is a slow batch as often as a hang."""
    h = short_job()
    h.sim.steps(300)
    found = stall_until_hang(h, 5, "data")
    [hang] = h.opened("hang")
    assert hang.evidence.limit_basis == "unclear_hang_floor"
    assert found >= Thresholds().unclear_hang_floor


def test_a_rank_stuck_in_data_doing_no_work_is_found_within_a_second_and_a_half() -> None:
    """Its heartbeats say its process and loader workers did nothing for ``quiet_floor``:
    a loader stuck, not refilling, so the fast floor applies."""
    h = short_job()
    h.sim.steps(300)
    found = stall_until_hang(h, 5, "data", quiet=True)
    [hang] = h.opened("hang")
    assert hang.evidence.limit_basis == "hang_floor" and hang.evidence.unclear == ""
    assert hang.evidence.phases["5"].quiet_for >= Thresholds().quiet_floor
    assert found <= 1.5


def test_a_loader_quiet_for_less_than_the_quiet_floor_keeps_the_unclear_floor() -> None:
    """A job whose loader may wait 3 s on storage says so (``quiet_floor``): the rank is
    judged only once its beats show that much quiet."""
    th = Thresholds(quiet_floor=3.0)
    h = short_job(th=th)
    h.sim.steps(300)
    found = stall_until_hang(h, 5, "data", quiet=True)
    assert found >= th.quiet_floor
    assert h.opened("hang")[0].evidence.phases["5"].quiet_for >= th.quiet_floor


def test_a_rank_saving_while_the_rest_wait_gets_the_checkpoint_phase_limit() -> None:
    h = short_job()
    h.sim.steps(300)
    h.sim.stall(30.0, lambda r: "checkpoint" if r == 0 else "comm")
    assert h.opened("hang") == []


def test_before_enough_steps_are_known_the_unclear_floor_applies() -> None:
    h = short_job()
    h.sim.steps(Thresholds().warmup_steps + 20)
    found = stall_until_hang(h, 2, "compute")
    assert found >= Thresholds().unclear_hang_floor
    assert h.opened("hang")[0].evidence.limit_basis == "unclear_hang_floor"


def test_ranks_that_do_not_beat_early_are_waited_for_before_the_floor_applies() -> None:
    """Without the early beat (an older client) the picture of the stall comes with the
    regular beat: still judged, by the floor, once every rank has been heard inside it."""
    h = short_job(early_beats=False)
    h.sim.steps(300)
    found = stall_until_hang(h, 3, "compute")
    assert 1.0 < found <= 1.0 + h.sim.cfg.hb_interval + 0.5


def test_most_ranks_busy_in_their_own_phase_is_no_wait() -> None:
    """Every rank in ``compute`` for 3 s (a recompile on all of them): nothing waits."""
    h = short_job()
    h.sim.steps(300)
    h.sim.stall(3.0, lambda r: "compute")
    assert h.opened("hang") == []


def test_the_floor_is_a_setting_for_the_job_that_needs_it() -> None:
    h = short_job(th=Thresholds(hang_floor=4.0))
    h.sim.steps(300)
    found = stall_until_hang(h, 3, "compute")
    assert found >= 4.0
    assert h.opened("hang")[0].evidence.hang_floor == 4.0


@pytest.mark.parametrize("seed", [1, 2])
def test_ten_minutes_of_irregular_50_ms_steps_raise_no_hang(seed: int) -> None:
    """Jittered steps with rare slow ones, a slow first step, data refills (some on one rank
    alone), evaluations and checkpoints: ten simulated minutes, no hang, no silence."""
    h = short_job(seed=seed, jitter=0.3, slow_step_prob=0.002, refill_every=300,
                  refill_seconds=(0.3, 2.5), refill_one_rank=0.3, eval_every=2500,
                  eval_seconds=(4.0, 12.0), checkpoint_every=1800, checkpoint_seconds=(2.0, 6.0))
    h.sim.stall(20.0, lambda r: "compute")  # compiling the first step
    while h.sim.now - h.sim.cfg.start_time < 600.0:
        h.sim.steps(200)
    assert h.sim.step > 5000
    assert [a for a in h.events if a.kind in ("hang", "unresponsive")] == []


def test_a_rank_that_has_not_completed_a_step_as_this_process_gets_the_startup_grace() -> None:
    """A replacement's first step (warming up, compiling) holds the rest: no step of its own
    says how long that should take, and a first step compiling takes as long as a job's."""
    h = short_job()
    h.sim.steps(300)
    h.job.revive(h.job.ranks[3], h.clock)
    found = stall_until_hang(h, 3, "compute", most=Thresholds().startup_grace + 12.0)
    assert found >= Thresholds().startup_grace
    [hang] = h.opened("hang")
    assert hang.evidence.limit_basis == "startup_grace"
    assert hang.evidence.unclear == "rank 3 on its first step"


@pytest.mark.parametrize("stepped_since", [False, True])
def test_a_survivor_on_its_first_step_after_the_group_went_on_at_another_size_gets_the_grace(
        stepped_since: bool) -> None:
    """Its group grew back (its hello at the new size): that step runs on a new mesh, which
    compiles anew like a new process's first step. Once it completed a step there, the
    fast floor is back."""
    h = short_job()
    h.sim.steps(300)
    cfg = h.sim.cfg
    h.detector.on_hello(RankHello(job=cfg.job, rank=3, world_size=cfg.ranks, host="node-0",
                                  attempt=Attempt(restart_count=h.sim.attempt), time=h.clock),
                        h.clock)
    if stepped_since:
        h.sim.steps(5)
    found = stall_until_hang(h, 3, "compute", most=Thresholds().startup_grace + 12.0)
    [hang] = h.opened("hang")
    if stepped_since:
        assert found <= 1.5 and hang.evidence.limit_basis == "hang_floor"
    else:
        assert found >= Thresholds().startup_grace
        assert hang.evidence.unclear == "rank 3 on its first step"


def test_every_rank_waiting_alike_names_no_culprit_and_gets_the_unclear_floor() -> None:
    """All in a collective, none behind (DDP's buckets in flight on every rank look so):
    who holds whom is not shown, so the fast floor does not apply."""
    h = short_job()
    h.sim.steps(300)
    onset = h.sim.now
    h.sim.stall(8.0, lambda r: "comm")
    [hang] = h.opened("hang")
    assert hang.evidence.limit_basis == "unclear_hang_floor"
    assert hang.evidence.unclear == "no rank holds the others up"
    assert hang.detected_at - onset >= Thresholds().unclear_hang_floor
    assert hang.evidence.hang_floor == Thresholds().unclear_hang_floor


def test_a_rank_behind_in_collectives_is_named_and_judged_fast() -> None:
    h = short_job()
    h.sim.steps(300)
    h.sim.coll_lag[6] = 1
    found = stall_until_hang(h, 6, "comm")
    assert found <= 1.5
    assert h.opened("hang")[0].evidence.culprit_basis == "coll_seq"


def test_a_rank_that_leaves_a_slow_batch_inside_the_stall_is_judged_on_its_new_phase() -> None:
    """Rank 3 refills its loader alone for 0.9 s (``data``, irregular) while the rest wait,
    then computes: the stall is past the 1 s floor as its first ``compute`` beat arrives, but
    the step it just began says nothing yet. Seen under load: a healthy rank was restarted."""
    h = short_job()
    h.sim.steps(300)
    onset = h.sim.now
    h.sim.stall_at(12.0, lambda r, t: "comm" if r != 3 else
                   "data" if t < onset + 0.9 else "compute")
    [hang] = h.opened("hang")
    assert hang.ranks == [3] and hang.evidence.limit_basis == "hang_floor"
    began = hang.evidence.phases["3"]
    assert began.phase == "compute"
    assert began.elapsed >= Thresholds().hang_floor, began


def test_a_detector_that_just_took_the_job_over_finds_its_hang_as_soon() -> None:
    """A takeover's grace holds silence for one ``hb_timeout`` (nothing heard yet); a hang
    is judged inside it once every rank has been heard since: a killed owner's job is not
    left unwatched for the grace."""
    h = short_job()
    h.sim.steps(300)
    h.detector.grace(h.clock, [h.sim.cfg.job])
    found = stall_until_hang(h, 3, "compute")
    assert found <= 1.5 < Thresholds().hb_timeout


def test_inside_the_grace_a_rank_not_heard_since_holds_every_judgement() -> None:
    h = short_job()
    h.sim.steps(300)
    h.sim.silent.add(6)
    h.detector.grace(h.clock, [h.sim.cfg.job])
    until = h.job.judge_after
    h.sim.stall(until - h.sim.now - 0.1, lambda r: "compute" if r == 3 else "comm")
    assert h.events == []
