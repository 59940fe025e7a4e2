"""What recovery reports mean for an incident (:mod:`services.remediator.recovery`), the
culprit restart of a hang, the reload verdict of an in-place rollback, and the budget's
generation-aware entries: pure tables, no bus."""

from __future__ import annotations

import pytest

from trainguard.contract.schemas import (
    AckOutcome,
    CommandAck,
    Diagnosis,
    Incident,
    IncidentStep,
    RecoveryReport,
)
from trainguard.services.remediator import endings, recovery
from trainguard.services.remediator.engine import JobView, open_incident, plan
from trainguard.services.remediator.policy import load_policy

NOW = 1_000_000.0
POLICY = load_policy()


def report(ident: str, at: float, *, path: str = "in_place", kind: str = "replace",
           reason: str = "", resumed: int = 18, lost: int = 0) -> RecoveryReport:
    return RecoveryReport(id=ident, job="j", rank=0, kind=kind, path=path,  # type: ignore[arg-type]
                          reason=reason, generation=5, previous_generation=4, world_size=4,
                          joined=[2], source_rank=0, failed_step=resumed, last_completed=17,
                          resumed_step=resumed, steps_lost=lost, seconds=0.7, time=at)


def crash(**kw: object) -> Incident:
    fields: dict[str, object] = {"id": "i1", "job": "j", "cause": "process_crash",
                                 "status": "mitigating", "onset_at": NOW - 10,
                                 "detected_at": NOW - 9, "failure_step": 17,
                                 "actions": [IncidentStep(action="restart", status="skipped")],
                                 **kw}
    return Incident(**fields)  # type: ignore[arg-type]


MATCHING = [
    # reports (id, time offset from onset, path, kind), wanted id
    ([], None),
    ([("old", -30.0, "in_place", "replace")], None),  # an earlier recovery
    ([("late", -0.4, "in_place", "replace")], "late"),  # within the clocks' slack
    ([("prior", -1.7, "in_place", "replace")], None),  # the previous failure's, 1.7 s before
    ([("a", 1.0, "restart", "replace"), ("b", 2.0, "in_place", "replace")], "b"),
    ([("b", 2.0, "in_place", "replace"), ("c", 3.0, "restart", "replace")], "c"),  # newest
    ([("r", 2.0, "in_place", "rollback")], None),  # not what a crash needs
]


@pytest.mark.parametrize(("reports", "wanted"), MATCHING)
def test_the_newest_report_after_the_onset_is_the_incidents(
        reports: list[tuple[str, float, str, str]], wanted: str | None) -> None:
    inc = crash()
    found = recovery.matching(inc, [report(i, NOW - 10 + dt, path=p, kind=k)
                                    for i, dt, p, k in reports])
    assert (found.id if found else None) == wanted


def test_a_rollback_incident_takes_rollback_reports() -> None:
    inc = crash(cause="numeric", actions=[IncidentStep(action="rollback")])
    found = recovery.matching(inc, [report("x", NOW, kind="replace"),
                                    report("y", NOW, kind="rollback")])
    assert found is not None and found.id == "y"


def test_an_isolation_takes_the_survivors_resize_as_its_restart() -> None:
    """An isolated host's survivors go on in place without it (a ``resize`` report):
    that is the restart the incident planned (its restart step waits a little for it)."""
    planned = crash(cause="hbm_ecc", failure_attempt=None, actions=[
        IncidentStep(action="isolate", status="running"), IncidentStep(action="restart")])
    assert not recovery.isolated(planned)
    inc = crash(cause="hbm_ecc", failure_attempt=None, actions=[
        IncidentStep(action="isolate", status="done"), IncidentStep(action="restart")])
    assert recovery.isolated(inc)
    assert recovery.matching(crash(), [report("s", NOW, kind="resize")]) is None
    assert recovery.apply(inc, [report("s", NOW, kind="resize", reason="host b left")])
    assert recovery.recovered_in_place(inc)
    assert "recovered in place" in recovery.skip_detail(inc)
    # The leaving agent's word (no source rank yet) is the re-form under way.
    word = RecoveryReport(id="w", job="j", rank=2, kind="resize", path="in_place",
                          reason="host b left: the group re-forms in place", generation=5,
                          world_size=2, time=NOW)
    assert recovery.under_way(word)
    fresh = crash(cause="hbm_ecc", failure_attempt=None, actions=[
        IncidentStep(action="isolate", status="done"), IncidentStep(action="restart")])
    assert recovery.apply(fresh, [word]) and recovery.recovered_in_place(fresh)
    assert "re-forms in place: no restart needed" in recovery.skip_detail(fresh)


def test_an_in_place_replacement_is_the_launchers_restart() -> None:
    inc = crash()
    assert recovery.apply(inc, [report("r1", NOW - 8)])
    assert not recovery.apply(inc, [report("r1", NOW - 8)])  # the same report: no revision
    assert recovery.recovered_in_place(inc)
    assert inc.recovery is not None and inc.recovery.back_at == NOW - 8
    assert "recovered in place in 0.70 s" in recovery.skip_detail(inc)
    assert "0 step(s) lost" in recovery.skip_detail(inc)


def test_the_agents_word_counts_before_the_group_runs_again() -> None:
    inc = crash()
    agent = RecoveryReport(id="ag", job="j", rank=2, kind="replace", path="in_place",
                           reason="rank 2 replaced in place on node-b: pid 7 -> 9 (warm "
                                  "spare), generation 5", generation=5, previous_generation=4,
                           world_size=4, joined=[2], time=NOW - 9)
    assert recovery.under_way(agent) and not recovery.under_way(report("r", NOW))
    assert recovery.apply(inc, [agent])
    assert recovery.recovered_in_place(inc)  # the launcher's restart: no second one
    assert inc.recovery is not None and inc.recovery.back_at is None
    assert inc.recovery.resumed_step is None and inc.recovery.steps_lost is None
    assert "re-forms in place" in recovery.skip_detail(inc)
    # Past failure step 17: it waits a while for the group's own report, not for ever.
    assert not recovery.resolved_in_place(inc, JobView(last_step=18), NOW)
    assert recovery.resolved_in_place(inc, JobView(last_step=18),
                                      NOW - 9 + recovery.GROUP_REPORT_WAIT_S)
    assert recovery.apply(inc, [agent, report("r", NOW - 8)])  # the group's own account
    assert inc.recovery.back_at == NOW - 8 and inc.recovery.steps_lost == 0


def test_a_fallback_says_why() -> None:
    inc = crash()
    why = "2 ranks failed at once (1, 2): in place replaces one"
    assert recovery.apply(inc, [report("f", NOW - 9, path="restart", reason=why)])
    assert inc.recovery is not None
    assert (inc.recovery.path, inc.recovery.reason) == ("restart", why)
    assert not recovery.recovered_in_place(inc) and inc.recovery.back_at is None


RESOLVED = [
    # last step seen, resumed step of the report, failure step: resolved
    (None, 18, 17, False),
    (17, 18, 17, False),  # the survivors' last step before the failure
    (18, 18, 17, True),  # the re-formed group ran the abandoned step again
    (20, 18, 25, False),  # a rollback: not past the failure yet
    (26, 18, 25, True),
]


@pytest.mark.parametrize(("last", "resumed", "failure", "resolved"), RESOLVED)
def test_an_in_place_incident_resolves_by_the_new_generations_progress(
        last: int | None, resumed: int, failure: int, resolved: bool) -> None:
    inc = crash(failure_step=failure, restarted_attempt=3)
    recovery.apply(inc, [report("r", NOW, resumed=resumed)])
    view = JobView(attempt=3, last_step=last)  # the survivors' attempt never rose
    assert recovery.resolved_in_place(inc, view, NOW) is resolved
    assert (endings.resolution(inc, view, set(), POLICY, NOW) == "progress") is resolved


def test_settling_in_place_takes_steps_lost_from_the_report() -> None:
    inc = crash()
    recovery.apply(inc, [report("r", NOW - 8, lost=0)])
    assert not endings.needs_resume_step(inc, "progress")
    endings.settle(inc, "progress", POLICY, NOW)
    assert (inc.status, inc.steps_lost, inc.resume_step) == ("resolved", 0, 18)


def test_a_cold_recovery_is_back_at_work_when_it_resolves() -> None:
    inc = crash(restarted_attempt=1)
    recovery.apply(inc, [report("f", NOW - 9, path="restart", reason="no in-place key")])
    assert endings.needs_resume_step(inc, "progress")
    endings.settle(inc, "progress", POLICY, NOW, resume_step=10)
    assert inc.recovery is not None and inc.recovery.back_at == NOW
    assert (inc.steps_lost, inc.recovery.path) == (7, "restart")


def test_a_restarted_group_counts_steps_lost_from_the_step_it_loaded() -> None:
    """Not from the coordinator's pointer at resolution: the restarted group may have
    committed again by then (failed at 17, loaded 9, committed 19 before resolving)."""
    inc = crash(restarted_attempt=1)
    recovery.apply(inc, [report("g", NOW - 5, path="restart", kind="resume", resumed=10,
                                reason="loaded step 9")])
    assert not endings.needs_resume_step(inc, "progress")
    endings.settle(inc, "progress", POLICY, NOW)
    assert (inc.resume_step, inc.steps_lost, inc.recovery.path) == (9, 8, "restart")  # type: ignore[union-attr]


def rank_ack(rank: int, outcome: AckOutcome) -> CommandAck:
    return CommandAck(command_id="c", job="j", responder=f"rank-{rank}", outcome=outcome,
                      detail="no handler" if outcome == "failed" else "")


RELOAD = [
    ([("done", r) for r in range(4)], 4, True, "every rank (4) reloaded in place"),
    ([("done", 0), ("done", 1), ("failed", 2), ("done", 3)], 4, False, "rank-2: failed"),
    ([("done", 0), ("done", 1)], 4, False, "no answer from rank-2, rank-3"),
    ([], 0, False, "0/0 ranks"),
]


@pytest.mark.parametrize(("acks", "world", "done", "said"), RELOAD)
def test_a_reload_is_in_place_only_when_every_rank_did_it(
        acks: list[tuple[AckOutcome, int]], world: int, done: bool, said: str) -> None:
    ok, detail = recovery.reload_verdict([rank_ack(r, o) for o, r in acks], world)
    assert ok is done and said in detail
    inc = crash(cause="numeric", actions=[
        IncidentStep(action="rollback", status="done", params={recovery.RELOADED: ok}),
        IncidentStep(action="restart")])
    assert recovery.rolled_back_in_place(inc) is done


def hang(ranks: list[int], hosts: list[str]) -> Diagnosis:
    return Diagnosis(id="d", job="j", anomaly_ids=["a"], cause="rank_hang", confidence=0.9,
                     ranks=ranks, hosts=hosts, step=40, time=NOW, onset_at=NOW - 6)


def test_a_hang_with_one_culprit_restarts_that_rank() -> None:
    d = hang([2], ["node-b"])
    steps, _ = plan(open_incident(d, NOW, NOW), d, POLICY, JobView(), NOW)
    restart = next(s for s in steps if s.action == "restart")
    assert restart.params == {"rank": 2, "host": "node-b", "fallback": "group"}
    d = hang([1, 2], ["node-a", "node-b"])
    steps, _ = plan(open_incident(d, NOW, NOW), d, POLICY, JobView(), NOW)
    assert next(s for s in steps if s.action == "restart").params == {}  # the group


def test_budget_entries_tell_in_place_failures_apart() -> None:
    """A rank replaced in place keeps its node's attempt; its replacement's generation is
    new, so a failure of each is an entry of its own."""
    assert endings.attempt_member(7) == "generation:7" != endings.attempt_member(8)
    assert endings.attempt_of("generation:7") == 7
    assert endings.attempt_of("restart:x") is None


@pytest.mark.parametrize("agent_first", [True, False])
def test_the_agents_phases_join_the_groups_account_whichever_came_first(
        agent_first: bool) -> None:
    inc = crash()
    agent = RecoveryReport(id="ag", job="j", rank=2, kind="replace", path="in_place",
                           generation=5, previous_generation=4, world_size=4, joined=[2],
                           phases={"decision": 0.002, "generation": 0.001, "spare": 0.01},
                           time=NOW - 9)
    group = report("r", NOW - 8)
    other = RecoveryReport(id="ot", job="j", rank=3, kind="replace", path="in_place",
                           generation=6, previous_generation=5, world_size=4, joined=[3],
                           phases={"decision": 9.0}, time=NOW - 9)  # another re-form
    first, then = ([agent, other], [agent, other, group]) if agent_first \
        else ([group], [group, other, agent])
    assert recovery.apply(inc, first)
    assert recovery.apply(inc, then)
    assert inc.recovery is not None and inc.recovery.report_id == "r"
    assert inc.recovery.agent_phases == agent.phases
    assert inc.recovery.phases == group.phases
    assert not recovery.apply(inc, then)  # nothing new
