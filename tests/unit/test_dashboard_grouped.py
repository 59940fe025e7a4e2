"""The dashboard's grouped view: outliers first, groups by host or failure domain, the
calm groups collapsed, the heat map's one character per rank."""

from __future__ import annotations

from trainguard.contract.schemas import Heartbeat, Incident, NodeHeartbeat, StepReport
from trainguard.dashboard.board import Board
from trainguard.dashboard.grouped import GROUPS_SHOWN

T0 = 1_000_000.0
PER_HOST = 4


def fed(ranks: int, slow: dict[int, float], steps: int = 12) -> Board:
    b = Board()
    for n in range(steps):
        for r in range(ranks):
            t = T0 + n * 0.2
            b.telemetry(Heartbeat(job="j", rank=r, time=t, host=f"h{r // PER_HOST}",
                                  phase="compute", phase_elapsed=0.05))
            b.telemetry(StepReport(job="j", rank=r, step=n, time=t, duration=0.5,
                                   phases={"compute": 0.1 * slow.get(r, 1.0),
                                           "comm": 0.5 - 0.1 * slow.get(r, 1.0)}))
    return b


def test_stuck_then_stopped_and_slow_first_then_the_rest_by_ratio() -> None:
    b = fed(16, {5: 2.0, 9: 1.5})
    now = T0 + 20
    b.telemetry(Heartbeat(job="j", rank=12, time=now, host="h3", phase="data",
                          phase_elapsed=9.0))
    b.telemetry(NodeHeartbeat(job="j", host="h0", time=now, ranks={2: "T"}))
    job = b.summary(now, top=4)["jobs"][0]
    assert [r["rank"] for r in job["top"]] == [2, 12, 5, 9]
    assert [r["stuck"] for r in job["top"]] == [True, True, False, False]
    assert job["top"][2]["slowest"] and job["top"][2]["ratio"] == 2.0
    assert (job["hung"], job["stopped"], job["slow"], job["world"]) == (1, 1, 2, 16)


def test_groups_by_host_worst_first_with_their_counts() -> None:
    b = fed(16, {9: 1.5})
    b.telemetry(Heartbeat(job="j", rank=12, time=T0 + 3, host="h3", phase="data",
                          phase_elapsed=9.0))
    job = b.summary(T0 + 3)["jobs"][0]
    names = [g["group"] for g in job["groups"]]
    assert names[0] == "h3" and names[1] == "h2"  # a hung rank, then the slowest
    h3 = job["groups"][0]
    assert (h3["ranks"], h3["hung"], h3["lost"], h3["worst_rank"], h3["worst_phase"]) == \
        (4, 1, 0, 12, "data")
    assert job["groups"][1]["slowest_ratio"] == 1.5 and job["collapsed"] is None


def test_hosts_lost_together_are_one_group_named_by_their_domain() -> None:
    b = fed(16, {})
    b.event(Incident(id="i", job="j", cause="hosts_lost", hosts=["h1", "h2"],
                     domain="switch sw-1", detected_at=T0 + 3))
    groups = {g["group"]: g for g in b.summary(T0 + 3)["jobs"][0]["groups"]}
    assert set(groups) == {"switch sw-1", "h0", "h3"}
    assert (groups["switch sw-1"]["kind"], groups["switch sw-1"]["ranks"],
            groups["switch sw-1"]["hosts"]) == ("domain", 8, 2)


def test_past_the_groups_shown_the_rest_is_one_collapsed_line() -> None:
    hosts = GROUPS_SHOWN + 10
    job = fed(hosts * PER_HOST, {}, steps=2).summary(T0)["jobs"][0]
    assert len(job["groups"]) == GROUPS_SHOWN
    assert job["collapsed"]["groups"] == 10
    assert sum(g["ranks"] for g in job["groups"]) + job["collapsed"]["ranks"] == \
        hosts * PER_HOST


def test_the_heat_map_is_one_character_per_rank_in_rank_order() -> None:
    b = fed(8, {3: 1.5, 6: 3.0})
    b.telemetry(Heartbeat(job="j", rank=1, time=T0 + 3, host="h0", phase="comm",
                          phase_elapsed=7.0))
    b.telemetry(NodeHeartbeat(job="j", host="h1", time=T0 + 3, ranks={4: "D"}))
    cells = b.cells("j")
    assert cells is not None and b.cells("other") is None
    assert cells["codes"] == "0W05S090" and cells["ranks"] is None and cells["world"] == 8
