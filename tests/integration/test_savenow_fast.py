"""Save-now that finishes or gives up fast (issue 16, item 2).

In the demo, the save-now before isolating node-b under XID 79 waited out its 60 s
deadline with "ranks [0, 1, 2] did not report (reported: [3])" though every rank had
saved: each report whose ``attempt`` differed from the record's started the step's round
over, and node-a's torchrun had counted restarts that node-b's had not. The round now
belongs to the worker group (``CheckpointReport.group_token``). And when the detector
already says a rank is stopped, dead or hung, the save is abandoned at once.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import msgspec

from tests.conftest import wait_until
from tests.integration.test_checkpointer import coordinator, write_shards
from tests.integration.test_checkpointer_commands import ranks, redis_client
from trainguard.runtime.state import Keys, Progress, RankProgress, encode_progress


async def test_ranks_of_nodes_at_different_attempts_commit_one_round(
        nats_url: str, redis_url: str, prefix: str, job: str, tmp_path: Path) -> None:
    async with coordinator(nats_url, redis_url, prefix, job) as c:
        node_a = write_shards(tmp_path, job, 100, 4, ranks=[0, 1], attempt=10)
        node_b = write_shards(tmp_path, job, 100, 4, ranks=[2, 3], attempt=7)
        reports = {**node_a, **node_b}
        for rank in (0, 2, 1, 3):  # interleaved, as they arrive from two nodes
            await c.report(msgspec.structs.replace(reports[rank], group_token="group-1"))
        event = await c.event(100, "committed")
        assert event.missing_ranks == [] and event.world_size == 4


async def test_a_report_of_another_worker_group_starts_the_round_over(
        nats_url: str, redis_url: str, prefix: str, job: str, tmp_path: Path) -> None:
    async with coordinator(nats_url, redis_url, prefix, job, commit_deadline=60) as c:
        old = write_shards(tmp_path, job, 200, 4, ranks=[0, 1])
        for rep in old.values():
            await c.report(msgspec.structs.replace(rep, group_token="group-1"))
        await wait_until(lambda: _reported(c, 200, [0, 1]), what="two ranks of group 1")
        (new,) = write_shards(tmp_path, job, 200, 4, ranks=[2]).values()
        await c.report(msgspec.structs.replace(new, group_token="group-2"))
        entry = await wait_until(lambda: _reported(c, 200, [2]), what="group 2's round")
        assert entry["status"] == "pending"


async def _reported(c: object, step: int, ranks: list[int]) -> dict[str, object] | None:
    entry = await c.entry(step)  # type: ignore[attr-defined]
    return entry if entry is not None and entry["reported"] == ranks else None


async def test_save_now_is_abandoned_at_once_when_a_rank_is_frozen(
        nats_url: str, redis_url: str, prefix: str, job: str, tmp_path: Path) -> None:
    """Rank 1 is SIGSTOPped (the agent says T, the detector's progress says ``stopped``):
    it will never reach the save's step, so the coordinator answers ``abandoned`` naming it
    instead of waiting out a 60 s deadline, and the remediator goes on to isolate."""
    async with coordinator(nats_url, redis_url, prefix, job) as c:
        with ranks(nats_url, prefix, job, tmp_path, ignore=(1,)) as group:
            await wait_until(lambda: min(r.step for r in group) >= 5, what="ranks stepping")
            step = group[0].step
            async with redis_client(redis_url) as r:
                await r.set(Keys(prefix).progress(job), encode_progress(Progress(
                    job=job, time=time.time(), world_size=2, last_step=step, min_step=step,
                    median_step_time=0.01, ranks={
                        0: RankProgress(rank=0, host="node-t", step=step, state="ok"),
                        1: RankProgress(rank=1, host="node-t", step=step, state="stopped",
                                        process_state="T")})))
            reply = json.loads(await c.rpc("save", {"deadline": 60, "reason": "test"},
                                           timeout=70))
        assert not reply["ok"] and reply["status"] == "abandoned", reply
        assert reply["missing_ranks"] == [1]
        assert "rank 1 stopped" in reply["reason"]
