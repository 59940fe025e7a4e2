"""The detector's rules for its own faults (pure): its view of the bus, its name, its
pending Redis writes, its leases by its own clock, and an agent's restart."""

from __future__ import annotations

import signal
from typing import Any

import pytest

from trainguard.agent.node import Failure, LocalNode, Worker
from trainguard.agent.settings import AgentSettings
from trainguard.contract.schemas import Heartbeat, NodeHeartbeat
from trainguard.runtime.config import load_settings
from trainguard.runtime.state import Keys
from trainguard.services.detector.busview import BusView
from trainguard.services.detector.identity import Claim, default_name, judge_claim
from trainguard.services.detector.leases import Leases
from trainguard.services.detector.synthetic import Harness, SimConfig
from trainguard.services.detector.thresholds import Thresholds
from trainguard.services.detector.writebehind import FieldWrites

# -- the view of the bus ------------------------------------------------------------------
# Steps: ("probe", sent, answered) or ("tick", now, connected, reconnects, verdict).
BUS_CASES = {
    "answered probes keep it current": [
        ("probe", 0.5, 0.51), ("tick", 1.0, True, 0, "current"),
        ("probe", 1.5, 1.51), ("tick", 2.4, True, 0, "current")],
    "no answer for stale_after is stale, then recovered once": [
        ("tick", 1.0, True, 0, "current"), ("tick", 2.5, True, 0, "stale"),
        ("tick", 3.0, True, 0, "stale"), ("probe", 3.2, 3.3),
        ("tick", 3.4, True, 0, "recovered"), ("tick", 3.6, True, 0, "current")],
    "a probe sent before the stall proves nothing after it": [
        ("tick", 2.5, True, 0, "stale"), ("probe", 0.9, 9.0),  # sent at 0.9, answered at 9
        ("tick", 9.1, True, 0, "stale"), ("probe", 9.1, 9.2),
        ("tick", 9.3, True, 0, "recovered")],
    "disconnected is stale even with fresh answers": [
        ("probe", 0.5, 0.6), ("tick", 0.7, False, 0, "stale"),
        ("tick", 0.8, True, 0, "recovered")],
    "a reconnect between two ticks is a stall that just ended": [
        ("probe", 0.5, 0.6), ("tick", 0.7, True, 1, "stale"),
        ("tick", 0.8, True, 1, "recovered")],
}


@pytest.mark.parametrize("steps", list(BUS_CASES.values()), ids=list(BUS_CASES))
def test_bus_view(steps: list[tuple[Any, ...]]) -> None:
    view = BusView(stale_after=1.0, now=0.0)
    for step in steps:
        if step[0] == "probe":
            view.answered(step[1], step[2])
        else:
            _, now, connected, reconnects, verdict = step
            assert view.observe(now, connected, reconnects) == verdict, step


def test_bus_view_counts_stalls_and_their_length() -> None:
    view = BusView(stale_after=1.0, now=0.0)
    for now in (2.0, 3.0, 4.0):
        view.observe(now, True, 0)
    assert view.stalls == 1 and view.stale_for(4.0) == 2.0
    view.answered(4.1, 4.2)
    view.observe(4.3, True, 0)
    assert view.stale_for(4.3) == 0.0 and view.rtt == pytest.approx(0.1)


def test_a_stalled_bus_pauses_silence_judgement_for_every_rank_then_a_grace() -> None:
    """What the service does with a stale view: grace every tick, so nobody is silent."""
    h = Harness(Thresholds(hb_timeout=5.0), SimConfig(ranks=8, ranks_per_host=4))
    h.sim.steps(30)
    h.muted = True  # the bus is frozen: nothing arrives, but the detector still ticks
    t0 = h.clock
    while h.clock < t0 + 20.0:
        h.clock += 0.25
        h.detector.grace(h.clock)  # stale view
        h.detector.tick(h.clock)
    h.muted = False
    h.sim.steps(10)
    assert h.events == []


# -- the name ---------------------------------------------------------------------------
ME = Claim("node-1", 100, "tok-me")
CLAIM_CASES = [
    (None, {}, (), "free"),
    (ME, {}, (), "mine"),
    (Claim("node-2", 100, "tok-x"), {}, (), "twin"),  # another machine: may be alive
    (Claim("node-1", 100, "tok-x"), {}, (), "predecessor"),  # our pid, not our token
    (Claim("node-1", 100, "tok-x"), {}, ("tok-x",), "twin"),  # a detector beside us
    (Claim("node-1", 200, "tok-x"), {200: True}, (), "twin"),
    (Claim("node-1", 200, "tok-x"), {200: False}, (), "predecessor"),
]


@pytest.mark.parametrize("found, running, live_here, verdict", CLAIM_CASES)
def test_a_name_is_taken_over_only_from_a_process_that_is_gone(
        found: Claim | None, running: dict[int, bool], live_here: tuple[str, ...],
        verdict: str) -> None:
    assert judge_claim(found, ME, running=lambda pid: running[pid],
                       live_here=live_here) == verdict


@pytest.mark.parametrize("instance_id, port, name", [
    ("det-a", 9100, "det-a"), ("", 9100, "node-1:9100"), ("", 0, "node-1")])
def test_default_name_is_stable_across_restarts(instance_id: str, port: int,
                                                name: str) -> None:
    assert default_name(instance_id, port, host="node-1") == name


def test_claims_round_trip_and_garbage_is_no_claim() -> None:
    assert Claim.decode(ME.encode()) == ME
    assert Claim.decode("nonsense") is None and Claim.decode(None) is None


# -- pending Redis writes ---------------------------------------------------------------
def test_pending_writes_keep_the_newest_value_per_field_and_survive_a_failed_write() -> None:
    w = FieldWrites()
    w.set("h", "hang", "rev1")
    w.set("h", "hang", "rev2")
    w.set("h", "pub:hang", "2")
    failed = w.take()
    assert failed == {("h", "hang"): "rev2", ("h", "pub:hang"): "2"} and len(w) == 0
    w.delete("h", "hang")  # resolved and published while the write was failing
    w.give_back(failed)
    assert w.take() == {("h", "pub:hang"): "2", ("h", "hang"): None}


def test_pending_writes_are_bounded() -> None:
    w = FieldWrites(limit=2)
    for i in range(5):
        w.set("h", f"f{i}", "x")
    assert list(w.take()) == [("h", "f3"), ("h", "f4")] and w.dropped == 3


# -- leases by our own clock ------------------------------------------------------------
def test_a_lease_counts_as_ours_only_until_its_deadline_by_our_clock() -> None:
    no_redis: Any = None  # the deadlines are pure bookkeeping
    leases = Leases(no_redis, Keys("tg"), "det", 10.0, "tg:detector:instances")
    leases.valid_until = {"a": 100.0, "b": 105.0}
    assert leases.lapsed(["a", "b", "never-taken"], 101.0) == ["a", "never-taken"]


# -- an agent's restart -------------------------------------------------------------------
def restarting(h: Harness, host: str, since: float, on: bool = True,
               attempt: int = 0) -> NodeHeartbeat:
    ranks = [r for r in range(h.sim.cfg.ranks) if h.sim.host(r) == host]
    return NodeHeartbeat(job=h.sim.cfg.job, time=h.clock, host=host, attempt=attempt,
                         ranks=dict.fromkeys(ranks, "S"), restarting=on,
                         restarting_since=since if on else None)


def test_a_restart_explains_its_hosts_silence_for_a_bounded_time() -> None:
    h = Harness(Thresholds(hb_timeout=5.0, restart_timeout=30.0),
                SimConfig(ranks=8, ranks_per_host=4))
    h.sim.steps(30)
    since = h.clock
    h.sim.silent.update({0, 1, 2, 3})  # node-0's workers are down
    for _ in range(20):  # 20 s of restart
        h.feed(restarting(h, "node-0", since))
        h.sim.stall(1.0, lambda r: "comm")
    assert h.events == [], "no unresponsive, and no hang while the group restarts"
    h.sim.silent.add(4)  # a rank of another host falls silent: still judged
    h.sim.stall(7.0, lambda r: "comm")
    assert [(a.kind, a.hosts) for a in h.opened("unresponsive")] == [("unresponsive",
                                                                     ["node-1"])]
    for _ in range(5):  # the restart goes on past restart_timeout: stuck, judged
        h.feed(restarting(h, "node-0", since))
        h.sim.stall(1.0, lambda r: "comm")
    assert [a.ranks for a in h.opened("unresponsive")] == [[4], [0, 1, 2, 3]]


def test_a_restart_ends_when_the_hosts_ranks_are_heard_in_the_new_attempt() -> None:
    h = Harness(Thresholds(hb_timeout=5.0, restart_timeout=60.0),
                SimConfig(ranks=4, ranks_per_host=4))
    h.sim.steps(10)
    since = h.clock
    h.sim.silent.update({0, 1, 2, 3})
    h.feed(restarting(h, "node-0", since))
    h.sim.stall(3.0, lambda r: "comm")
    h.feed(restarting(h, "node-0", since, on=False, attempt=1))  # new group started...
    h.sim.stall(5.0, lambda r: "comm")
    assert h.job.restarting and h.events == [], "...but not heard from yet"
    for r in range(4):
        h.feed(Heartbeat(job=h.sim.cfg.job, time=h.clock, rank=r, host="node-0", attempt=1))
    h.feed(restarting(h, "node-0", since, on=False, attempt=1))
    assert not h.job.restarting and h.job.attempt == 1


def test_gone_processes_of_a_restarting_host_are_no_crash() -> None:
    h = Harness(Thresholds(hb_timeout=5.0), SimConfig(ranks=4, ranks_per_host=4))
    h.sim.steps(10)
    since = h.clock
    h.sim.silent.update({0, 1, 2, 3})
    for _ in range(10):
        beat = restarting(h, "node-0", since)
        beat.ranks = dict.fromkeys(beat.ranks, "X")
        h.feed(beat)
        h.sim.stall(1.0, lambda r: "comm")
    assert h.events == []


def test_the_agent_says_restarting_from_a_failure_or_a_restart_until_workers_start() -> None:
    settings = load_settings(AgentSettings, env={}, overrides={"job": "j", "host": "node-a"})
    node = LocalNode(settings, hosts_store=False, gpu=None, publish_exit=lambda e: None)
    node.workers_started([Worker(0, 0, 100, None), Worker(1, 1, 101, None)], 0)
    assert node.restarting_since is None
    node.workers_exited({1: Failure(1, 1, 101, 1, "boom")}, succeeded=False)
    began = node.restarting_since
    assert began is not None
    node.workers_exited({0: Failure(0, 0, 100, -signal.SIGTERM)}, succeeded=False)
    assert node.restarting_since == began, "one restart, one start time"
    node.workers_started([Worker(0, 0, 200, None), Worker(1, 1, 201, None)], 1)
    assert node.restarting_since is None
    node.workers_exited({}, succeeded=True)
    assert node.restarting_since is None, "a finished job does not restart"
