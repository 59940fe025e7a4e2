"""The coordinator's summary of the ranks' memory snapshots
(``trainguard.services.checkpointer.memory``), its series and its row in
``trainguard checkpoints``: pure, from reports made up here."""

from __future__ import annotations

import msgspec
from prometheus_client import CollectorRegistry

from trainguard.cli.checkpoints import format_catalogue
from trainguard.contract.rpc import MemorySummary
from trainguard.contract.schemas import SnapshotReport
from trainguard.runtime.jobmetrics import MemorySnapshotMetrics
from trainguard.services.checkpointer.memory import Held, Pending, summarize

NOW = 1_000.0


def held(rank: int, step: int, kept: list[int], *, taken: float, at: float = NOW - 1,
         world: int = 3, host: int = 3 << 20, copy: float = 0.01, every: int = 1,
         sent: float | None = None) -> Held:
    return Held(at=at, report=SnapshotReport(
        job="j", time=taken if sent is None else sent, rank=rank, step=step, taken=taken,
        bytes=host // 3, copy_seconds=copy, check_seconds=2 * copy, every=every,
        kept_steps=kept, oldest_taken=taken - 10 * (step - kept[0]), host_bytes=host,
        world_size=world))


def test_the_newest_every_rank_holds_is_the_lowest_of_the_ranks_newest() -> None:
    ranks = {0: held(0, 30, [10, 29, 30], taken=NOW - 2, host=3 << 20, copy=0.01),
             1: held(1, 28, [12, 27, 28], taken=NOW - 4, host=6 << 20, copy=0.03, every=2),
             2: held(2, 31, [11, 30, 31], taken=NOW - 1)}
    s = summarize(ranks, NOW)
    assert s is not None
    assert (s.newest_step, s.oldest_step) == (28, 12)  # every rank holds 28, and one as old as 12
    assert (s.taken, s.age) == (NOW - 4, 4.0)  # rank 1's snapshot of step 28
    assert s.oldest_taken == NOW - 4 - 160 and s.oldest_age == 164.0
    assert (s.host_bytes, s.bytes, s.copy_seconds, s.every) == (6 << 20, 2 << 20, 0.03, 2)
    assert s.check_seconds == 0.06
    assert (s.ranks, s.world_size) == ([0, 1, 2], 3)


def test_stale_ranks_and_ranks_beyond_the_world_drop_out() -> None:
    ranks = {0: held(0, 30, [30], taken=NOW - 2),
             1: held(1, 5, [5], taken=NOW - 700, at=NOW - 700),  # silent past the ttl
             2: held(2, 31, [31], taken=NOW - 1)}
    s = summarize(ranks, NOW, ttl=600)
    assert s is not None and s.ranks == [0, 2] and s.newest_step == 30
    # The job shrank to 2 ranks (the newest report says so): rank 2 is gone.
    ranks[0] = held(0, 32, [32], taken=NOW - 0.5, world=2)
    s = summarize(ranks, NOW, ttl=600)
    assert s is not None and s.ranks == [0] and s.world_size == 2
    assert summarize({1: ranks[1]}, NOW, ttl=600) is None
    assert summarize({}, NOW) is None


def test_pending_keeps_the_newest_per_rank_until_taken() -> None:
    p = Pending()
    for step in (1, 2, 3):
        p.note(held(0, step, [step], taken=NOW).report, NOW)
    p.note(held(1, 2, [2], taken=NOW).report, NOW)
    out = p.take()
    assert {k: h.report.step for k, h in out.items()} == {("j", 0): 3, ("j", 1): 2}
    assert len(p) == 0 and p.take() == {}


def test_the_memory_row_sits_in_the_catalogue_table_beside_the_checkpoints() -> None:
    summary = summarize({0: held(0, 30, [10, 29, 30], taken=NOW - 2, host=12 << 20),
                         1: held(1, 29, [11, 28, 29], taken=NOW - 3)}, NOW)
    assert summary is not None
    data = {"job": "j", "pointer": None, "memory": msgspec.to_builtins(summary),
            "checkpoints": [{"step": 20, "status": "committed", "reported": [0, 1],
                             "world_size": 2, "bytes": 1 << 30, "seconds_blocked": 0.4,
                             "seconds_total": 2.0, "closed_at": NOW}]}
    lines = format_catalogue(data).splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("STEP"))
    memory, committed = lines[header + 1].split(), lines[header + 2].split()
    assert memory[:5] == ["29", "held", "memory", "2/3", "12.0MB"]
    assert committed[:4] == ["20", "committed", "full", "2/2"]
    assert lines[header].index("KIND") == lines[header + 1].index("memory")
    assert "oldest kept 11" in lines[header + 1] and "newest 3s old" in lines[header + 1]
    # Memory snapshots and nothing committed yet: the row alone.
    alone = format_catalogue({"job": "j", "memory": msgspec.to_builtins(summary)})
    assert alone.splitlines()[-1].split()[:3] == ["29", "held", "memory"]
    assert "no checkpoints" not in alone


def test_the_series_follow_the_summary_and_go_with_it() -> None:
    registry = CollectorRegistry()
    m = MemorySnapshotMetrics(registry)
    m.show("j", MemorySummary(newest_step=28, oldest_step=12, age=4.0, copy_seconds=0.03,
                              host_bytes=6 << 20))

    def value(name: str) -> float | None:
        return registry.get_sample_value(name, {"training_job": "j"})

    assert value("trainguard_memory_snapshot_age_seconds") == 4.0
    assert value("trainguard_memory_snapshot_step") == 28
    assert value("trainguard_memory_snapshot_copy_seconds") == 0.03
    assert value("trainguard_memory_snapshot_host_bytes") == 6 << 20
    m.show("j", None)
    assert value("trainguard_memory_snapshot_age_seconds") is None
    m.show("j", None)  # nothing left to remove


def test_the_buddies_newest_copy_every_rank_has_is_summed_up_and_shown() -> None:
    ranks = {r: held(r, 30, [29, 30], taken=NOW - 1, world=2) for r in (0, 1)}
    s = summarize(ranks, NOW)
    assert s is not None and (s.buddy_step, s.buddy_bytes) == (-1, 0)  # no buddies
    ranks[0].report.buddy_sent, ranks[0].report.buddy_bytes = [28, 30], 2 << 20
    s = summarize(ranks, NOW)
    assert s is not None and s.buddy_step == -1  # rank 1's shard is held nowhere else
    ranks[1].report.buddy_sent, ranks[1].report.buddy_bytes = [26, 28], 4 << 20
    s = summarize(ranks, NOW)
    assert s is not None and (s.buddy_step, s.buddy_bytes) == (28, 4 << 20)
    row = format_catalogue({"job": "j", "memory": msgspec.to_builtins(s)})
    assert "buddies hold 28 (4.0MB per rank)" in row
