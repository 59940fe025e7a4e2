"""The remediator's step, ack, resolution and hold rules: pure tables, no bus (the plans are
in test_remediator_policy.py)."""

from __future__ import annotations

import pytest

from trainguard.contract.rpc import RollbackReply, SaveReply
from trainguard.contract.schemas import (
    AckOutcome,
    CommandAck,
    Diagnosis,
    EvidenceItem,
    Incident,
    IncidentStep,
    WorkerExit,
)
from trainguard.runtime.state import NodeRecord
from trainguard.services.remediator import conduct, endings, engine
from trainguard.services.remediator.engine import JobView
from trainguard.services.remediator.policy import load_policy

NOW = 1_000_000.0
POLICY = load_policy()


def incident(*steps: tuple[str, str], **kw: object) -> Incident:
    """An incident whose plan is ``(action, status)`` pairs."""
    fields: dict[str, object] = {"id": "i1", "job": "j", "cause": "process_crash",
                                 "status": "mitigating", "detected_at": NOW - 30,
                                 "failure_step": 100, **kw}
    return Incident(actions=[IncidentStep(action=a, status=s) for a, s in steps],  # type: ignore[arg-type]
                    **fields)  # type: ignore[arg-type]


def ack(host: str, outcome: AckOutcome, detail: str = "") -> CommandAck:
    return CommandAck(command_id="c1", job="j", responder=f"host-{host}", outcome=outcome,
                      detail=detail)


NEXT = [
    ((), None),
    ((("restart", "pending"),), 0),
    ((("save_now", "skipped"), ("restart", "sent")), 1),  # sent, not acked: re-sent
    ((("alert", "done"), ("restart", "failed"), ("rollback", "pending")), 2),
    ((("alert", "done"), ("restart", "done")), None),
]


@pytest.mark.parametrize(("steps", "index"), NEXT)
def test_next_step(steps: tuple[tuple[str, str], ...], index: int | None) -> None:
    assert engine.next_step(incident(*steps)) == index


CONCLUDE = [
    # steps, escalation, mitigated before: changed, status after
    ((("restart", "done"),), "", None, True, "mitigating"),
    ((("alert", "done"),), "", None, True, "mitigating"),
    ((("escalate", "done"),), "cause unknown", None, True, "escalated"),
    ((("escalate", "done"), ("restart", "done")), "cannot isolate", None, True, "mitigating"),
    ((("escalate", "done"), ("restart", "skipped")), "cannot isolate", None, True,
     "mitigating"),  # the launcher restarted it: still recovering
    ((("restart", "done"),), "", NOW - 5, False, "mitigating"),  # concluded before
    ((), "", None, False, "mitigating"),  # nothing was planned
]


@pytest.mark.parametrize(("steps", "escalation", "mitigated", "changed", "status"), CONCLUDE)
def test_conclude(steps: tuple[tuple[str, str], ...], escalation: str, mitigated: float | None,
                  changed: bool, status: str) -> None:
    inc = incident(*steps, escalation=escalation, mitigated_at=mitigated)
    assert engine.conclude(inc, NOW) is changed
    assert inc.status == status
    assert inc.mitigated_at == (NOW if changed else mitigated)


FINISH = [
    # action, status, detail: incident status, escalation
    ("restart", "done", "ok", "mitigating", ""),
    ("save_now", "skipped", "no checkpoint", "mitigating", ""),
    ("escalate", "done", "node-a runs the store", "mitigating", "node-a runs the store"),
    ("isolate", "failed", "no ack", "escalated", "isolate failed: no ack"),
    ("hold", "done", "host-node-a: done holding", "failed", "host-node-a: done holding"),
    ("hold", "skipped", "nothing to hold", "failed", "nothing to hold"),  # launchers gone
    ("hold", "failed", "no ack", "escalated", "hold failed: no ack"),  # it may still run
    # Evidence only: a rank that could not dump does not stop the restart after it.
    ("dump", "failed", "host-node-a: refused no rank", "mitigating", ""),
]


@pytest.mark.parametrize(("action", "status", "detail", "after", "escalation"), FINISH)
def test_finish_step(action: str, status: str, detail: str, after: str,
                     escalation: str) -> None:
    inc = incident((action, status))
    inc.actions[0].detail = detail
    engine.finish_step(inc, inc.actions[0])
    assert (inc.status, inc.escalation) == (after, escalation)


def test_the_first_step_starts_mitigation_once() -> None:
    inc = incident(("save_now", "pending"), ("restart", "pending"), status="open")
    engine.start_step(inc, inc.actions[0], NOW)
    engine.start_step(inc, inc.actions[1], NOW + 3)
    assert inc.status == "mitigating" and inc.first_action_at == NOW
    assert [s.at for s in inc.actions] == [NOW, NOW + 3]


GRACE = [
    ("escalate", {"grace": 10.0}, 10.0),
    ("escalate", {"grace": 10.0, "waited": True}, 0.0),
    ("escalate", {"reason": "budget spent"}, 0.0),
    ("restart", {"grace": 10.0}, 0.0),
]


@pytest.mark.parametrize(("action", "params", "seconds"), GRACE)
def test_grace_to_wait(action: str, params: dict[str, object], seconds: float) -> None:
    assert engine.grace_to_wait(IncidentStep(action=action, params=params)) == seconds


def test_a_replan_keeps_done_steps_and_drops_their_repeats() -> None:
    current = [IncidentStep(action="save_now", params={"deadline": 60}, status="done"),
               IncidentStep(action="restart", status="sent", command_ids=["c1"])]
    planned = [IncidentStep(action="save_now", params={"deadline": 60}),
               IncidentStep(action="save_now", params={"deadline": 30}),
               IncidentStep(action="isolate", params={"host": "node-b"}),
               IncidentStep(action="restart")]
    merged = engine.merge_plan(current, planned)
    assert [(s.action, s.params, s.status) for s in merged] == [
        ("save_now", {"deadline": 60}, "done"), ("save_now", {"deadline": 30}, "pending"),
        ("isolate", {"host": "node-b"}, "pending"), ("restart", {}, "pending")]


def test_replan_notes_why_the_plan_differs() -> None:
    d = Diagnosis(id="d2", job="j", anomaly_ids=["a"], cause="rank_hang", confidence=0.9,
                  hosts=["node-b"], ranks=[3], time=NOW)
    inc = incident(("alert", "done"), cause="rank_hang", hosts=["node-b"], ranks=[3],
                   summary="rank 3 hung")
    policy = load_policy()
    engine.replan(inc, d, policy, JobView(), NOW)
    assert [s.action for s in inc.actions] == ["alert", "dump", "restart"]
    assert inc.actions[1].params == {"host": "node-b", "ranks": [3]}
    assert inc.summary == "rank 3 hung"  # the policy's plan, unchanged: no notes


ACKS = [
    # acks, expected hosts: status, retry, detail contains
    ([], ["node-a"], "failed", True, "no acknowledgement of restart from node-a"),
    ([ack("node-a", "done")], ["node-a"], "done", False, "host-node-a: done"),
    ([ack("node-a", "failed", "boom"), ack("node-b", "done")], ["node-a", "node-b"], "done",
     False, "host-node-a: failed boom"),
    ([ack("node-a", "failed", "boom")], ["node-a"], "failed", True, "boom"),
    ([ack("node-a", "refused", "stale epoch")], ["node-a"], "failed", False, "stale epoch"),
    ([ack("node-a", "too_late")], ["node-a"], "failed", True, "too_late"),
]


@pytest.mark.parametrize(("acks", "hosts", "status", "retry", "detail"), ACKS)
def test_ack_verdict(acks: list[CommandAck], hosts: list[str], status: str, retry: bool,
                     detail: str) -> None:
    verdict = engine.ack_verdict(acks, hosts, "restart")
    assert (verdict.status, verdict.retry) == (status, retry)
    assert detail in verdict.detail


def test_a_silent_retry_keeps_what_the_first_send_heard() -> None:
    first = engine.ack_verdict([ack("node-a", "failed", "disk full")], ["node-a"], "dump")
    second = engine.ack_verdict([], ["node-a"], "dump", first.detail)
    assert second.status == "failed" and "disk full" in second.detail


COMPLETE = [
    ([], [], False),
    ([ack("node-a", "done")], [], True),  # nobody named: any answer will do
    ([ack("node-a", "done")], ["node-a", "node-b"], False),
    ([ack("node-a", "done"), ack("node-b", "failed")], ["node-a", "node-b"], True),
]


@pytest.mark.parametrize(("acks", "hosts", "complete"), COMPLETE)
def test_acks_complete(acks: list[CommandAck], hosts: list[str], complete: bool) -> None:
    assert engine.acks_complete(acks, hosts) is complete


LAUNCHER = [
    # cause, failure attempt, a worker exited, attempt now: waits, already restarted
    ("process_crash", 0, True, 0, True, False),
    ("process_crash", 0, True, 1, True, True),
    ("oom", 2, True, None, True, False),
    ("process_crash", None, True, 3, False, False),  # failure attempt unknown: cannot tell
    ("hbm_ecc", 2, False, 2, False, False),  # ECC read from NVML: no worker ended
    ("network", 0, False, 1, False, True),  # a hang: the launcher does not restart, but it did
]


@pytest.mark.parametrize(("cause", "failed_in", "exited", "attempt", "waits", "restarted"),
                         LAUNCHER)
def test_launcher_restart(cause: str, failed_in: int | None, exited: bool,
                          attempt: int | None, waits: bool, restarted: bool) -> None:
    inc = incident(("restart", "pending"), cause=cause, failure_attempt=failed_in,
                   worker_exited=exited)
    assert engine.waits_for_launcher(inc) is waits
    assert engine.launcher_restarted(inc, JobView(attempt=attempt)) is restarted


def test_a_restart_the_launcher_did_is_skipped() -> None:
    inc = incident(("restart", "pending"), failure_attempt=0)
    engine.skip_restart(inc, inc.actions[0], JobView(attempt=1))
    assert inc.actions[0].status == "skipped" and "attempt 1" in inc.actions[0].detail
    assert inc.restarted_attempt == 0  # resolution needs an attempt after the failed one


SAVES = [
    (SaveReply(ok=True, job="j", status="committed", step=80), "", "done", "committed step 80"),
    (SaveReply(ok=False, job="j", status="timeout", reason="ranks 2 missing"), "", "skipped",
     "ranks 2 missing"),
    (SaveReply(ok=False, job="j", status="failed"), "", "skipped", "save failed"),
    (None, "", "skipped", "the coordinator has no checkpoint"),
    (None, "no answer from the checkpoint coordinator (NoRespondersError())", "skipped",
     "no answer from the checkpoint coordinator (NoRespondersError())"),
]


@pytest.mark.parametrize(("reply", "error", "status", "detail"), SAVES)
def test_save_outcome(reply: SaveReply | None, error: str, status: str, detail: str) -> None:
    assert engine.save_outcome(reply, error) == (status, detail)


ROLLBACKS = [
    (RollbackReply(ok=True, job="j", step=60), "", "done", "resume pointer at step 60"),
    (RollbackReply(ok=False, job="j", reason="nothing below step 10"), "", "failed",
     "nothing below step 10"),
    (RollbackReply(ok=False, job="j"), "", "failed", "no checkpoint"),
    (RollbackReply(ok=False, job="j", memory_step=7, reason="memory only"), "", "done",
     "memory only"),
    (None, "", "failed", "the coordinator has no checkpoint"),
    (None, "no answer from the checkpoint coordinator (TimeoutError())", "failed",
     "no answer from the checkpoint coordinator (TimeoutError())"),
]


@pytest.mark.parametrize(("reply", "error", "status", "detail"), ROLLBACKS)
def test_rollback_outcome(reply: RollbackReply | None, error: str, status: str,
                          detail: str) -> None:
    assert engine.rollback_outcome(reply, error) == (status, detail)


@pytest.mark.parametrize(("step_status", "action_status"), [
    ("done", "acked"), ("failed", "failed"), ("skipped", "skipped"), ("sent", "sent"),
    ("pending", "sent")])
def test_action_events_carry_the_step(step_status: str, action_status: str) -> None:
    inc = incident(("restart", step_status), diagnosis_ids=["d1", "d2"])
    inc.actions[0].command_ids.append("c7")
    event = engine.action_event(inc, inc.actions[0], NOW)
    assert (event.status, event.action, event.incident_id, event.diagnosis_id,
            event.command_ids, event.time) == (action_status, "restart", "i1", "d2", ["c7"],
                                               NOW)


RESOLVE = [
    # steps, restarted attempt, anomalies, view, resolved anomalies, now: verdict
    ((("restart", "done"),), 0, ["a1"], JobView(attempt=1, last_step=101), set(), NOW,
     "progress"),
    ((("restart", "done"),), 0, ["a1"], JobView(attempt=0, last_step=150), set(), NOW, None),
    ((("restart", "done"),), 0, ["a1"], JobView(attempt=1, last_step=99), {"a1"}, NOW, None),
    ((("alert", "done"),), None, ["a1", "a2"], JobView(), {"a1", "a2"}, NOW, "anomalies"),
    ((("alert", "done"),), None, ["a1", "a2"], JobView(), {"a1"}, NOW, None),
    ((("alert", "done"),), None, ["a1"], JobView(), set(), NOW + 600, "timeout"),
    ((("restart", "done"),), 0, ["a1"], JobView(attempt=0), set(), NOW + 600, "timeout"),
]


@pytest.mark.parametrize(("steps", "restarted", "anomalies", "view", "resolved", "now",
                          "verdict"), RESOLVE)
def test_resolution(steps: tuple[tuple[str, str], ...], restarted: int | None,
                    anomalies: list[str], view: JobView, resolved: set[str], now: float,
                    verdict: str | None) -> None:
    inc = incident(*steps, restarted_attempt=restarted, anomaly_ids=anomalies)
    assert endings.resolution(inc, view, resolved, POLICY, now) == verdict


def test_an_alert_only_incident_without_anomalies_resolves_once_mitigated() -> None:
    inc = incident(("alert", "done"), anomaly_ids=[])
    assert endings.resolution(inc, JobView(), set(), POLICY, NOW) == "anomalies"


SETTLE = [
    # verdict, restarted attempt, resume step: status, steps lost, resume step needed
    ("progress", 0, 80, "resolved", 20, True),
    ("progress", None, None, "resolved", None, False),
    ("anomalies", None, None, "resolved", None, False),
    ("timeout", 0, None, "escalated", None, False),
]


@pytest.mark.parametrize(("why", "restarted", "resume", "status", "lost", "needed"), SETTLE)
def test_settle(why: endings.Resolution, restarted: int | None, resume: int | None,
                status: str, lost: int | None, needed: bool) -> None:
    inc = incident(("restart", "done"), restarted_attempt=restarted)
    assert endings.needs_resume_step(inc, why) is needed
    endings.settle(inc, why, POLICY, NOW, resume)
    assert (inc.status, inc.steps_lost, inc.resume_step) == (status, lost, resume)
    assert inc.resolved_at == (None if why == "timeout" else NOW)
    assert ("not resolved within" in inc.escalation) is (why == "timeout")


def test_the_blocklist_entry_names_the_incident() -> None:
    inc = incident(("isolate", "pending"), cause="hbm_ecc", summary="")
    entry = engine.blocklist_entry(inc, NOW)
    assert (entry.reason, entry.cause, entry.job, entry.incident, entry.time) == (
        "hbm_ecc", "hbm_ecc", "j", "i1", NOW)


@pytest.mark.parametrize(("rev", "sent", "detected"), [(1, NOW - 4, NOW - 4), (2, NOW - 4, NOW),
                                                        (1, 0.0, NOW)])
def test_detected_at(rev: int, sent: float, detected: float) -> None:
    d = Diagnosis(id="d", job="j", anomaly_ids=[], cause="oom", confidence=0.5, rev=rev,
                  time=sent)
    assert engine.detected_at(d, NOW) == detected


# -- crash loops and holds ----------------------------------------------------------------

def worker_exit(code: int | None = 1, sig: str | None = None, by: str | None = None,
                attempt: int = 4, age: float = 5.0, host: str = "node-a",
                generation: int = 9) -> WorkerExit:
    return WorkerExit(id="e1", job="j", host=host, rank=1, exit_code=code, signal=sig,
                      initiated_by=by, attempt=attempt, generation=generation,
                      time=NOW - age)


ENDED = [
    (worker_exit(), "generation:9"),  # a crash: torchrun restarts the group (or gives up)
    (worker_exit(code=-9, sig="SIGKILL"), "generation:9"),
    (worker_exit(code=None), "generation:9"),  # the agent confirms the process is gone
    (worker_exit(code=0), None),  # finished
    (worker_exit(code=-15, sig="SIGTERM", by="launcher"), None),  # a peer's teardown
    (worker_exit(code=-15, sig="SIGTERM", by="cmd-7"), None),  # our restart: counted there
    (worker_exit(age=4000), None),  # replayed, older than the hour
    (worker_exit(generation=0), "attempt:4"),  # an older agent: its node's count
]


@pytest.mark.parametrize(("ex", "entry"), ENDED)
def test_which_exits_count_against_the_budget(ex: WorkerExit, entry: str | None) -> None:
    assert endings.exit_entry(ex, NOW) == entry


def test_budget_entries_are_per_generation() -> None:
    assert endings.attempt_member(4) == endings.attempt_member(4) == "generation:4"
    unknown = endings.attempt_member(None)
    assert unknown != endings.attempt_member(None) and endings.attempt_of(unknown) is None
    assert endings.attempt_member(0) != endings.attempt_member(0)  # no progress yet
    assert [endings.attempt_of(m) for m in ("generation:4", "generation:x", "xgeneration:4",
                                            "attempt:4", "attempt:4:9")] == [
        4, None, None, None, None]


def budget(*entries: str | None) -> set[str]:
    """The budget's sorted set after ``entries`` (``ZADD NX``: a member counts once)."""
    return {e for e in entries if e is not None}


def test_one_failure_seen_on_two_hosts_then_restarted_by_the_remediator_counts_once() -> None:
    """Generation 9 dies: node-a's rank crashes (its node restarted 4 times), node-b's
    ranks fail on their lost peer (node-b joined later: its count is 1), and the
    remediator restarts the job, which the detector sees at generation 9."""
    a = worker_exit(host="node-a", attempt=4, generation=9)
    b = worker_exit(host="node-b", attempt=1, generation=9)
    inc = Incident(id="i1", job="j", cause="process_crash", failure_attempt=2,
                   failure_generation=9, worker_exited=True)
    step = IncidentStep(action="restart", status="running")
    view = JobView(hosts={h: NodeRecord(job="j", host=h) for h in ("node-a", "node-b")},
                   attempt=2, generation=9)
    send = conduct.restart(inc, step, view)
    assert isinstance(send, conduct.Send) and send.counts
    entries = budget(endings.exit_entry(a, NOW), endings.exit_entry(b, NOW),
                     endings.attempt_member(send.attempt))
    assert entries == {"generation:9"}
    ended = JobView(restarts_last_hour=len(entries),
                    ended_attempts=frozenset(map(endings.attempt_of, entries)) - {None})
    assert engine.restarts_after(inc, ended) == 1  # the restart it needs is that one


def test_a_crash_loop_of_k_failures_counts_k() -> None:
    """torchrun restarts the group after each crash: a new generation each time, whatever
    each node's own count says (a node that restarted alone is ahead of the others)."""
    exits = [worker_exit(host=host, attempt=attempt + skew, generation=10 + attempt)
             for attempt in range(5) for host, skew in (("node-a", 0), ("node-b", 3))]
    entries = budget(*(endings.exit_entry(ex, NOW) for ex in exits))
    assert len(entries) == 5


def test_a_rank_replaced_in_place_fails_again_in_a_new_generation() -> None:
    """A rank replaced in place keeps its node's attempt; the replacement runs in a new
    generation, so its own failure is a new entry (and a peer's view of it is not)."""
    first = worker_exit(attempt=4, generation=9)
    again = worker_exit(attempt=4, generation=10)
    peer = worker_exit(host="node-b", attempt=0, generation=10)
    assert len(budget(*(endings.exit_entry(ex, NOW) for ex in (first, again, peer)))) == 2


def crash_diagnosis(cause: str = "process_crash", *evidence: EvidenceItem,
                    ranks: tuple[int, ...] = (1,), hosts: tuple[str, ...] = ("node-a",)
                    ) -> Diagnosis:
    return Diagnosis(id="d1", job="j", anomaly_ids=["a1"], cause=cause,  # type: ignore[arg-type]
                     confidence=0.7, ranks=list(ranks), hosts=list(hosts),
                     evidence=list(evidence))


EXITED = EvidenceItem(fact="exited with code 1, no hardware or OOM evidence", source="exit",
                      value="RuntimeError: bad batch 17")
TRACEBACK = EvidenceItem(fact="traceback signature", source="exit", value="3f2a9c01b7de")
PEER = EvidenceItem(fact="peer error after rank 1 on node-a exited first", source="exit",
                    value="0190-exit-id")
DETECTOR = EvidenceItem(fact="crash anomaly on ranks [1]", source="detector", value="a1")

SIGNATURES = [
    (crash_diagnosis("process_crash", DETECTOR, EXITED, TRACEBACK),
     "process_crash: rank 1 on node-a: RuntimeError: bad batch 17 [traceback 3f2a9c01b7de]"),
    (crash_diagnosis("oom", EvidenceItem(fact="CUDA out of memory", source="exit",
                                         value="CUDA out of memory. Tried to allocate")),
     "oom: rank 1 on node-a: CUDA out of memory. Tried to allocate"),
    (crash_diagnosis("network", PEER, ranks=(0, 1), hosts=("node-a", "node-b")),
     "network: ranks 0, 1 on node-a, node-b"),  # a peer's exit id is no stderr line
    (crash_diagnosis("unknown", DETECTOR, ranks=(), hosts=()), "unknown: the job"),
]


@pytest.mark.parametrize(("d", "expected"), SIGNATURES)
def test_the_failure_signature(d: Diagnosis, expected: str) -> None:
    assert endings.signature(d) == expected


def test_an_incident_keeps_the_newest_signature_with_an_exit_line() -> None:
    inc = incident(("restart", "skipped"))
    endings.sign(inc, crash_diagnosis("process_crash", DETECTOR))
    assert inc.signature == "process_crash: rank 1 on node-a"  # better than nothing
    endings.sign(inc, crash_diagnosis("process_crash", EXITED))
    endings.sign(inc, crash_diagnosis("process_crash", DETECTOR))  # no line: kept
    endings.sign(inc, crash_diagnosis("network", PEER))  # not this incident's cause
    assert inc.signature == "process_crash: rank 1 on node-a: RuntimeError: bad batch 17"


HOST = {"node-a": NodeRecord(job="j", host="node-a")}

EXITED_LAUNCHERS = [
    # cause, steps, status, registered hosts: every launcher exited
    ("process_crash", (("restart", "skipped"),), "mitigating", {}, True),
    ("process_crash", (("restart", "skipped"),), "mitigating", HOST, False),
    ("rank_hang", (("dump", "done"), ("restart", "done")), "mitigating", {}, True),
    ("rank_hang", (("restart", "failed"),), "mitigating", {}, False),  # never reached one
    ("numeric", (("rollback", "pending"),), "open", {}, False),  # no launcher seen: plain torchrun
    ("process_crash", (("hold", "done"),), "failed", {}, False),  # closed already
]


@pytest.mark.parametrize(("cause", "steps", "status", "hosts", "exited"), EXITED_LAUNCHERS)
def test_launcher_exited(cause: str, steps: tuple[tuple[str, str], ...], status: str,
                         hosts: dict[str, NodeRecord], exited: bool) -> None:
    inc = incident(*steps, cause=cause, status=status)
    assert endings.launcher_exited(inc, JobView(hosts=dict(hosts))) is exited
    moot = endings.moot(inc, JobView(hosts=dict(hosts)), "hold")
    assert (moot is not None) is exited
    if moot is not None:
        assert moot.status == "skipped" and "every launcher of the job has exited" in moot.detail


BUDGET = POLICY.restart_budget_per_hour
HOLDS = [
    # cause, steps, restarts in the hour, repeats, hosts: why it is held (None: it is not)
    ("process_crash", (("restart", "skipped"),), BUDGET, 1, HOST, None),
    ("process_crash", (("restart", "skipped"),), BUDGET + 1, 1, HOST, "restart budget spent"),
    ("process_crash", (("restart", "skipped"),), 2, 3, HOST, "process_crash 3 times"),
    ("process_crash", (("restart", "skipped"),), 2, 2, HOST, None),  # escalate_after = 3
    ("oom", (("restart", "skipped"),), 0, 2, HOST, "oom 2 times"),  # escalate_after = 2
    ("rank_hang", (("dump", "done"), ("restart", "done")), BUDGET + 1, 1, HOST,
     "restart budget spent"),
    ("straggler", (("alert", "done"),), BUDGET + 1, 9, HOST, None),  # nothing restarts it
    ("process_crash", (("restart", "skipped"),), 0, 1, {}, "every launcher of the job"),
    ("process_crash", (("restart", "skipped"), ("escalate", "done"), ("hold", "sent")),
     BUDGET + 5, 9, HOST, None),  # held once
]


@pytest.mark.parametrize(("cause", "steps", "restarts", "repeats", "hosts", "reason"), HOLDS)
def test_hold_reason(cause: str, steps: tuple[tuple[str, str], ...], restarts: int,
                     repeats: int, hosts: dict[str, NodeRecord], reason: str | None) -> None:
    inc = incident(*steps, cause=cause)
    view = JobView(hosts=dict(hosts), restarts_last_hour=restarts,
                   cause_count_last_hour=repeats)
    got = endings.hold_reason(inc, view, POLICY)
    assert (got is None) is (reason is None)
    assert reason is None or (got is not None and reason in got)


def test_a_held_crash_loop_tells_on_call_once_then_fails() -> None:
    inc = incident(("restart", "skipped"), signature="process_crash: rank 1 on node-a: boom")
    inc.actions.extend(engine.hold_steps(inc, "restart budget spent (7 restarts ...)"))
    escalate, hold = inc.actions[1:]
    assert (escalate.action, hold.action) == ("escalate", "hold")
    assert escalate.params["reason"] == ("holding the job: restart budget spent (7 restarts "
                                         "...); failure: process_crash: rank 1 on node-a: boom")
    escalate.status, escalate.detail = "done", str(escalate.params["reason"])
    engine.finish_step(inc, escalate)
    assert inc.status == "mitigating"
    hold.status, hold.detail = "done", "host-node-a: done holding the job"
    engine.finish_step(inc, hold)
    assert inc.status == "failed" and "process_crash: rank 1 on node-a: boom" in inc.escalation
    assert endings.hold_reason(inc, JobView(restarts_last_hour=99), POLICY) is None


RESTARTS_AFTER = [
    # failed attempt, restarts in the hour, attempts among them: restarts once it is counted
    (3, 4, {1, 2, 3}, 4),
    (3, 4, {1, 2}, 5),  # its exit is not counted yet
    (None, 4, {1, 2}, 5),
]


@pytest.mark.parametrize(("failed_in", "restarts", "attempts", "after"), RESTARTS_AFTER)
def test_restarts_after(failed_in: int | None, restarts: int, attempts: set[int],
                        after: int) -> None:
    inc = incident(("restart", "pending"), failure_generation=failed_in)
    view = JobView(restarts_last_hour=restarts, ended_attempts=frozenset(attempts))
    assert engine.restarts_after(inc, view) == after


def test_the_acks_of_a_group_command_make_a_bounded_detail() -> None:
    """2,048 agents answer a group's restart: the step's detail (saved and published with
    the incident on every revision) counts them and names only those that did not
    succeed or did not answer, a few of each."""
    hosts = [f"node-{h}" for h in range(2048)]
    acks = [ack(h, "done", "restarting 8 local ranks in a new attempt " * 4)
            for h in hosts[:2040]] + [ack(h, "failed", "disk full") for h in hosts[2040:2045]]
    verdict = engine.ack_verdict(acks, hosts, "restart")
    assert verdict.status == "done" and not verdict.retry
    assert len(verdict.detail) < 2_000
    assert "2045 of 2048 agents answered: 2040 done, 5 failed" in verdict.detail
    assert "host-node-2040: failed disk full" in verdict.detail
    assert "no answer from node-2045, node-2046, node-2047" in verdict.detail
    silent = engine.ack_verdict([], hosts, "restart")
    assert len(silent.detail) < 2_000 and "and 2040 more" in silent.detail
