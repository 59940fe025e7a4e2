"""Running an incident's steps (:mod:`services.remediator.conduct`) and the watch's verdict
on an incident whose steps have run (:func:`services.remediator.endings.review`): pure
tables, no bus; the shell's side is in tests/integration/test_remediator_service.py."""

from __future__ import annotations

from typing import Any

import pytest

from trainguard.contract.rpc import MEMORY_ONLY, RollbackReply
from trainguard.contract.schemas import (
    AckOutcome,
    CommandAck,
    HookRun,
    Incident,
    IncidentStep,
    RecoveryReport,
    ResumePoint,
)
from trainguard.runtime.state import NodeRecord
from trainguard.services.remediator import conduct, endings, recovery
from trainguard.services.remediator.engine import JobView, Outcome
from trainguard.services.remediator.policy import load_policy

NOW = 1_000_000.0
POLICY = load_policy()
HOSTS = {h: NodeRecord(job="j", host=h) for h in ("node-b", "node-a")}


def step(action: str, status: str = "pending", **params: Any) -> IncidentStep:
    return IncidentStep(action=action, status=status, params=params)  # type: ignore[arg-type]


def incident(*steps: IncidentStep, **kw: Any) -> Incident:
    fields: dict[str, Any] = {"id": "i1", "job": "j", "cause": "process_crash",
                              "status": "mitigating", "onset_at": NOW - 10,
                              "detected_at": NOW - 9, "failure_step": 17, "failure_attempt": 4,
                              "worker_exited": True,
                              "summary": "rank 3 on node-b: process_crash", **kw}
    return Incident(actions=list(steps), **fields)


def replaced(at: float = NOW - 5) -> RecoveryReport:
    """The agent's word that it replaced a rank in place (the launcher's restart)."""
    return RecoveryReport(id="r1", job="j", rank=3, kind="replace", path="in_place",
                          reason="rank 3 replaced", generation=5, previous_generation=4,
                          world_size=4, time=at)


def regrouped(at: float = NOW - 5) -> RecoveryReport:
    """The re-formed group's own report: back at work at step 18, one step lost."""
    return RecoveryReport(id="r2", job="j", rank=0, kind="replace", path="in_place",
                          reason="rank 3 replaced", generation=5, previous_generation=4,
                          world_size=4, source_rank=0, resumed_step=18, steps_lost=1,
                          seconds=0.7, time=at)


def ack(outcome: AckOutcome, host: str = "node-b", detail: str = "") -> CommandAck:
    return CommandAck(command_id="c1", job="j", responder=f"host-{host}", outcome=outcome,
                      detail=detail)


# -- the executor's next move ------------------------------------------------------------

MOVES = [
    # incident (None: gone), its steps: index, grace, save, status after
    (None, (), None, 0.0, False, None),
    ("resolved", (step("restart", "done"),), None, 0.0, False, "resolved"),
    ("mitigating", (step("restart", "done"),), None, 0.0, True, "mitigating"),  # concluded
    ("open", (step("escalate", reason="cause unknown", grace=10.0),), 0, 10.0, False, "open"),
    ("open", (step("escalate", grace=10.0, waited=True),), 0, 0.0, False, "mitigating"),
    ("mitigating", (step("save_now", "skipped"), step("restart", "sent")), 1, 0.0, False,
     "mitigating"),  # sent, not acknowledged: runs again
]


@pytest.mark.parametrize(("status", "steps", "index", "grace", "save", "after"), MOVES)
def test_next_move(status: str | None, steps: tuple[IncidentStep, ...], index: int | None,
                   grace: float, save: bool, after: str | None) -> None:
    inc = None if status is None else incident(*steps, status=status)
    move = conduct.next_move(inc, NOW)
    assert (move.index, move.grace, move.save) == (index, grace, save)
    assert (inc.status if inc else None) == after
    if inc is not None and index is not None:
        started = not grace
        assert (inc.actions[index].at == NOW) is started
        assert (inc.first_action_at == NOW) is started


def test_a_concluded_incident_is_saved_once() -> None:
    inc = incident(step("restart", "done"))
    assert conduct.next_move(inc, NOW).save and inc.mitigated_at == NOW
    assert conduct.next_move(inc, NOW + 1) == conduct.Move()


@pytest.mark.parametrize(("replanned", "marked"), [(False, True), (True, False)])
def test_a_grace_waited_out_is_marked_unless_replanned(replanned: bool, marked: bool) -> None:
    before = incident(step("escalate", grace=10.0))
    fresh = incident(step("escalate", grace=10.0))
    if replanned:
        fresh.actions = [step("isolate", host="node-b"), step("restart")]
    assert conduct.waited(fresh, before, 0) is marked
    assert bool(fresh.actions[0].params.get("waited")) is marked


# -- what a step needs done --------------------------------------------------------------

ISOLATE = conduct.Send("isolate", ["node-b"], host="node-b", counts=True)
ACTS: list[tuple[IncidentStep, conduct.Act]] = [
    (step("alert"), Outcome("done", "alert: rank 3 on node-b: process_crash")),
    (step("escalate", reason="cause unknown"), Outcome("done", "cause unknown")),
    (step("escalate"), Outcome("done", "escalated to a human")),
    (step("save_now", deadline=30), conduct.Save(30.0)),
    (step("save_now"), conduct.Save(60.0)),
    (step("rollback", below_step=340), conduct.Rollback(340)),
    (step("dump", host="node-b", ranks=[3]),
     conduct.Send("dump", ["node-b"], {"ranks": [3]}, host="node-b")),
    (step("dump", host="node-b"), conduct.Send("dump", ["node-b"], host="node-b")),
    (step("dump", hosts=["node-a", "node-b"], ranks=[1, 3]), conduct.SendEach([
        conduct.Send("dump", ["node-a"], {"ranks": [1, 3]}, host="node-a"),
        conduct.Send("dump", ["node-b"], {"ranks": [1, 3]}, host="node-b")])),
    (step("isolate", host="node-b"), conduct.Isolate(ISOLATE)),
    (step("restart"), conduct.Restart()),
    (step("restart", rank=3, host="node-b"), conduct.Restart()),
    (step("hold", reason="budget"), conduct.Hold()),
    (step("reboot"), Outcome("skipped", "unknown action reboot")),
]


@pytest.mark.parametrize(("s", "expected"), ACTS)
def test_act(s: IncidentStep, expected: conduct.Act) -> None:
    assert conduct.act(incident(s), s) == expected


def test_a_step_sent_before_is_sent_again_as_a_retry() -> None:
    s = step("dump", "sent", host="node-b")
    s.command_ids.extend(["c1", "c2"])
    act = conduct.act(incident(s), s)
    assert isinstance(act, conduct.Send) and act.retry_of == "c2"


def test_a_step_without_its_host_fails() -> None:
    with pytest.raises(KeyError):
        conduct.act(incident(step("isolate")), step("isolate"))


def test_a_restart_after_a_reload_in_place_is_moot() -> None:
    rollback = step("rollback", "done", **{recovery.RELOADED: True})
    restart = step("restart")
    assert conduct.act(incident(rollback, restart, cause="numeric"), restart) == Outcome(
        "skipped", "rolled back in place on every rank: no process restarted")


# -- restarts and holds ------------------------------------------------------------------

WAITS = [
    # cause, failure attempt, a worker exited, an isolation done, the culprit's restart:
    # (seconds, every)
    ("process_crash", 4, True, False, False, [(POLICY.launcher_grace_s, 1.0)]),
    ("process_crash", None, True, False, False, []),  # failure attempt unknown: nothing to see
    ("rank_hang", 4, False, False, False, []),  # the launcher does not restart a hang
    ("hbm_ecc", 4, True, True, False,
     [(recovery.RESIZE_WAIT_S, 0.5), (POLICY.launcher_grace_s, 1.0)]),
    # ECC read from NVML, every worker still running: nothing would restart the group
    ("hbm_ecc", 4, False, False, False, []),
    ("hbm_ecc", 4, False, True, False, [(recovery.RESIZE_WAIT_S, 0.5)]),
    ("gpu_lost", None, False, True, False, [(recovery.RESIZE_WAIT_S, 0.5)]),
    ("rank_hang", 4, False, False, True, []),
]


@pytest.mark.parametrize(("cause", "failed_in", "exited", "isolated", "culprit", "waits"),
                         WAITS)
def test_restart_waits(cause: str, failed_in: int | None, exited: bool, isolated: bool,
                       culprit: bool, waits: list[tuple[float, float]]) -> None:
    restart = step("restart", rank=3, host="node-b") if culprit else step("restart")
    steps = (step("isolate", "done", host="node-b"), restart) if isolated else (restart,)
    inc = incident(*steps, cause=cause, failure_attempt=failed_in, worker_exited=exited)
    assert [(w.seconds, w.every) for w in conduct.restart_waits(inc, restart, POLICY)] == waits


def test_the_launcher_wait_ends_on_its_restart_or_a_replacement_in_place() -> None:
    inc = incident(step("restart"))
    _, launcher = [None, *conduct.restart_waits(inc, inc.actions[0], POLICY)]
    assert launcher is not None
    assert not launcher.until(inc, JobView(attempt=4))
    assert launcher.until(inc, JobView(attempt=5))
    assert launcher.until(inc, JobView(attempt=4, recoveries=(replaced(),)))


RESTARTS = [
    # the culprit's restart, view: outcome (status, detail part) or send (kind, hosts,
    # params, host, the generation it counts), the incident's restarted attempt after
    (False, JobView(hosts=dict(HOSTS), attempt=4, generation=12),
     ("restart", ["node-a", "node-b"], {}, None, 12), 4),
    (False, JobView(hosts=dict(HOSTS), attempt=4),  # no generation known: a new entry
     ("restart", ["node-a", "node-b"], {}, None, None), 4),
    (False, JobView(hosts=dict(HOSTS), attempt=5), ("skipped", "already restarted"), 4),
    (False, JobView(hosts=dict(HOSTS), attempt=4, recoveries=(replaced(),)),
     ("skipped", "re-forms in place"), None),
    (False, JobView(attempt=4), ("skipped", "nothing to restart"), None),
    (True, JobView(hosts=dict(HOSTS), attempt=5, generation=12),
     ("restart", ["node-b"], {"rank": 3, "fallback": "group"}, "node-b", None), 5),
    (True, JobView(attempt=5), ("skipped", "nothing to restart"), None),
]


@pytest.mark.parametrize(("culprit", "view", "expected", "restarted"), RESTARTS)
def test_restart(culprit: bool, view: JobView, expected: tuple[Any, ...],
                 restarted: int | None) -> None:
    restart = step("restart", rank=3, host="node-b") if culprit else step("restart")
    inc = incident(restart)
    got = conduct.restart(inc, restart, view)
    if isinstance(got, conduct.Send):
        assert (got.kind, got.hosts, got.params, got.host, got.attempt) == expected
        assert got.counts and got.everyone is (got.host is None)
    else:
        status, part = expected
        assert got.status == status and part in got.detail
    assert inc.restarted_attempt == restarted


@pytest.mark.parametrize(("view", "expected"), [
    (JobView(hosts=dict(HOSTS)), conduct.Send("hold", ["node-a", "node-b"])),
    (JobView(), Outcome("skipped", "nothing to hold: every launcher of the job has exited")),
])
def test_hold(view: JobView, expected: conduct.Act) -> None:
    hold = step("hold", reason="budget")
    got = conduct.hold(incident(step("restart", "skipped"), hold), hold, view)
    assert got == expected
    assert not isinstance(got, conduct.Send) or (got.everyone and not got.counts)


# -- what came back ----------------------------------------------------------------------

SENDS = [
    # acks of the first send, of the second: status after each, whether it is worth sending
    # again (the shell sends at most conduct.SENDS times)
    ([], [ack("done")], [("failed", True), ("done", False)]),
    ([ack("failed", detail="disk full")], [],
     [("failed", True), ("failed", True)]),  # the second send's silence keeps the reason
    ([ack("refused", detail="stale epoch")], None, [("failed", False)]),
    ([ack("done")], None, [("done", False)]),
]


@pytest.mark.parametrize(("first", "second", "expected"), SENDS)
def test_judge(first: list[CommandAck], second: list[CommandAck] | None,
               expected: list[tuple[str, bool]]) -> None:
    s = step("dump", host="node-b")
    send = conduct.Send("dump", ["node-b"], host="node-b")
    got = []
    for n, acks in enumerate(a for a in (first, second) if a is not None):
        conduct.sent(s, f"c{n}")
        assert s.status == "sent"
        again = conduct.judge(s, acks, send)
        got.append((s.status, again))
    assert got == expected
    assert s.command_ids == [f"c{n}" for n in range(len(expected))]
    if second == [] and first:
        assert "disk full" in s.detail


@pytest.mark.parametrize(("status", "detail", "summary"), [
    ("ok", "host-node-b: done isolated", "host-node-b: done isolated; hook ok (1.5 s)"),
    ("failed", "", "hook failed exit 3: no such node"),
])
def test_note_hook(status: str, detail: str, summary: str) -> None:
    s = step("isolate", "done", host="node-b")
    s.detail = detail
    run = HookRun(argv=["cordon", "node-b"], status=status, exit_code=0 if status == "ok"  # type: ignore[arg-type]
                  else 3, output="no such node", elapsed=1.5)
    line = conduct.note_hook(s, run)
    assert s.detail == summary and s.hook == run and summary.endswith(line)


# -- rollback in place -------------------------------------------------------------------

POINT = ResumePoint(job="j", step=60, path="/ckpt/60")
RELOAD_POINTS = [
    ("done", RollbackReply(ok=True, job="j", step=60, point=POINT), (60, "/ckpt/60")),
    ("done", RollbackReply(ok=True, job="j", step=60), (60, "")),
    ("failed", RollbackReply(ok=False, job="j", reason="nothing below"), None),
    ("failed", None, None),
    # Nothing on disk yet, but every rank's memory goes back far enough.
    ("done", RollbackReply(ok=False, job="j", memory_step=7), (MEMORY_ONLY, "")),
]


@pytest.mark.parametrize(("status", "reply", "point"), RELOAD_POINTS)
def test_reload_point(status: str, reply: RollbackReply | None,
                      point: tuple[int, str] | None) -> None:
    assert conduct.reload_point(step("rollback", status), reply) == point


def test_no_reload_in_place_without_the_world_size() -> None:
    s = step("rollback", "done")
    s.detail = "resume pointer at step 60"
    assert conduct.reload(s, JobView(), 60, "/ckpt/60") is None
    assert s.detail.endswith("no reload in place: the job's world size is unknown")


@pytest.mark.parametrize(("answered", "reloaded"), [((0, 1), True), ((0,), False)])
def test_reload(answered: tuple[int, ...], reloaded: bool) -> None:
    s = step("rollback", "done")
    s.detail = "resume pointer at step 60"
    reload = conduct.reload(s, JobView(world_size=2), 60, "/ckpt/60")
    assert reload == conduct.Reload({"step": 60, "path": "/ckpt/60"}, ["rank-0", "rank-1"])
    acks = [CommandAck(command_id="c1", job="j", responder=f"rank-{r}", outcome="done")
            for r in answered]
    conduct.reloaded(s, acks, 2)
    assert s.params[recovery.RELOADED] is reloaded
    assert s.detail.startswith("resume pointer at step 60; ")
    assert ("restarting the group" in s.detail) is not reloaded


# -- the watch ---------------------------------------------------------------------------

REVIEWS = [
    # steps, restarted attempt, view, resolved anomalies: resolution, resume, hold, save
    ((step("restart", "done"),), 4, JobView(hosts=dict(HOSTS), attempt=5, last_step=18),
     set(), "progress", True, None, True),  # restarted by us: from where it resumed
    ((step("restart", "skipped"),), 4,
     JobView(hosts=dict(HOSTS), attempt=4, last_step=30, recoveries=(regrouped(),)),
     set(), "progress", False, None, True),  # in place: the report says
    ((step("alert", "done"),), None, JobView(hosts=dict(HOSTS)), {"a1"}, "anomalies", False,
     None, True),
    ((step("restart", "done"),), 4, JobView(hosts=dict(HOSTS), attempt=4, last_step=10),
     set(), None, False, None, False),  # nothing yet
    ((step("restart", "skipped"),), 4,
     JobView(hosts=dict(HOSTS), attempt=4, last_step=10, recoveries=(replaced(),)),
     set(), None, False, None, True),  # the recovery noted: a revision of its own
    ((step("restart", "skipped"),), 4,
     JobView(hosts=dict(HOSTS), attempt=5, last_step=10,
             restarts_last_hour=POLICY.restart_budget_per_hour + 1),
     set(), None, False, "restart budget spent", True),
    ((step("restart", "skipped"),), 4, JobView(attempt=4, last_step=10), set(), None, False,
     "every launcher of the job has exited", True),
]


@pytest.mark.parametrize(("steps", "restarted", "view", "resolved", "resolution", "resume",
                          "hold", "save"), REVIEWS)
def test_review(steps: tuple[IncidentStep, ...], restarted: int | None, view: JobView,
                resolved: set[str], resolution: str | None, resume: bool, hold: str | None,
                save: bool) -> None:
    inc = incident(*steps, restarted_attempt=restarted, anomaly_ids=["a1"])
    got = endings.review(inc, view, resolved, POLICY, NOW)
    assert (got.resolution, got.resume, got.save) == (resolution, resume, save)
    assert (got.hold is None) is (hold is None)
    assert hold is None or (got.hold is not None and got.hold.startswith(hold))
    held = [s.action for s in inc.actions[len(steps):]]
    assert held == ([] if hold is None else ["escalate", "hold"])
