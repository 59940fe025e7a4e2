"""In-place recovery as the remediator sees it, on real NATS and Redis: recovery reports
consumed from ``recovery.<rank>``, the restart an in-place replacement makes moot, the
fallback that says why, a hang's culprit restarted alone, and a rollback reloaded in place.
The agents are the real executor rules over a fake worker table (as in
test_remediator_service.py); ranks are stand-ins that answer ``reload``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from tests.conftest import wait_until
from tests.integration.test_remediator_service import (
    diagnosis,
    leading,
    seed,
    stage,
)
from trainguard.contract.codec import decode_durable
from trainguard.contract.rpc import ROLLBACK, RollbackReply, RollbackRequest
from trainguard.contract.schemas import Command, CommandAck, Incident, RecoveryReport, ResumePoint
from trainguard.contract.subjects import Subjects
from trainguard.runtime.bus import Bus
from trainguard.runtime.state import Keys, Progress, encode_progress


def recovered(job: str, ident: str, *, path: str = "in_place", kind: str = "replace",
              reason: str = "", resumed: int = 121, lost: int = 0) -> RecoveryReport:
    return RecoveryReport(id=ident, job=job, rank=0, kind=kind, path=path,  # type: ignore[arg-type]
                          reason=reason, generation=4, previous_generation=3, world_size=4,
                          joined=[3], source_rank=0, failed_step=resumed,
                          last_completed=resumed - 1, resumed_step=resumed, steps_lost=lost,
                          seconds=0.6, time=time.time())


async def test_an_in_place_replacement_needs_no_restart_and_resolves_by_progress(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any) -> None:
    agents, seen = await stage(nc, redis_url, prefix, job)
    s = Subjects(prefix)
    async with leading(nats_url, redis_url, prefix) as svc:
        bus = Bus(nc, s, source="test")
        await bus.publish_durable(s.event(job, "diagnosis"), diagnosis(job, "d1"))
        await wait_until(lambda: seen, what="incident open")
        # The agent replaced rank 3 in place; the new group's rank 0 says so once it runs.
        await bus.publish_durable(s.recovery(job, 0), recovered(job, "rec-1"))
        await wait_until(lambda: any(i.actions and i.actions[0].status == "skipped"
                                     for i in seen), timeout=30, what="restart skipped")
        # Same attempt (the survivors keep theirs): the re-formed group runs step 121.
        await seed(redis_url, prefix, job, attempt=0, step=121)
        await wait_until(lambda: any(i.status == "resolved" for i in seen), timeout=30,
                         what="resolved")
        stored = await svc.store.recoveries(job, time.time())
    final = seen[-1]
    assert [r.id for r in stored] == ["rec-1"]
    assert final.actions[0].action == "restart"
    assert "recovered in place in 0.60 s" in final.actions[0].detail
    assert final.recovery is not None and final.recovery.path == "in_place"
    assert (final.steps_lost, final.resume_step) == (0, 121)
    assert final.recovery.back_at is not None
    assert agents.commands == []  # nothing restarted


async def test_a_group_restart_records_why_in_place_did_not_run(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any) -> None:
    _, seen = await stage(nc, redis_url, prefix, job)
    s = Subjects(prefix)
    why = "2 ranks failed at once (2, 3): in place replaces one"
    async with leading(nats_url, redis_url, prefix):
        bus = Bus(nc, s, source="test")
        await bus.publish_durable(s.event(job, "diagnosis"), diagnosis(job, "d1"))
        await wait_until(lambda: seen, what="incident open")
        await bus.publish_durable(s.recovery(job, 0), recovered(job, "fb", path="restart",
                                                                reason=why))
        await seed(redis_url, prefix, job, attempt=1, step=121)  # torchrun restarted it
        await wait_until(lambda: any(i.status == "resolved" for i in seen), timeout=30,
                         what="resolved")
    final = seen[-1]
    assert final.recovery is not None
    assert (final.recovery.path, final.recovery.reason) == ("restart", why)
    assert final.recovery.back_at == final.resolved_at
    assert "already restarted" in final.actions[0].detail


async def test_a_hangs_culprit_is_restarted_alone_on_its_host(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any, tmp_path: Path) -> None:
    agents, seen = await stage(nc, redis_url, prefix, job)
    s = Subjects(prefix)
    async with leading(nats_url, redis_url, prefix, tmp_path, "ack_timeout_s = 5"):
        bus = Bus(nc, s, source="test")
        await bus.publish_durable(s.event(job, "diagnosis"),
                                  diagnosis(job, "d1", "rank_hang"))
        await wait_until(lambda: agents.executed("restart"), timeout=30, what="restart")
        # The agent ran it before the remediator saw the ack: wait for the saved step.
        await wait_until(lambda: any(i.actions[-1].action == "restart"
                                     and i.actions[-1].status == "done" for i in seen),
                         timeout=30, what="the restart step done")
    restart = next(c for c in agents.commands if c.kind == "restart")
    assert restart.target == "host.node-b"
    assert restart.params == {"rank": 3, "fallback": "group"}
    assert agents.nodes["node-b"].calls[-1] == f"restart:3:{restart.id}:group"
    assert not agents.nodes["node-a"].calls


async def answer_rollback(nc: Any, s: Subjects, job: str) -> list[RollbackRequest]:
    """A stand-in coordinator that moves the pointer to step 100; the requests it got."""
    got: list[RollbackRequest] = []

    async def cb(msg: Any) -> None:
        got.append(ROLLBACK.decode_request(msg.data))
        await msg.respond(ROLLBACK.encode_reply(RollbackReply(
            ok=True, job=job, step=100, point=ResumePoint(job=job, step=100,
                                                          path="/ckpt/step-100"))))

    await nc.subscribe(ROLLBACK.subject(s, job), cb=cb)
    return got


async def ranks_answering_reload(nc: Any, s: Subjects, job: str,
                                 outcomes: dict[int, str]) -> list[Command]:
    """Stand-ins for the ranks: each answers ``reload`` on ``cmd.all`` with its outcome."""
    got: list[Command] = []
    bus = Bus(nc, s, source="test-ranks")

    async def cb(msg: Any) -> None:
        cmd = decode_durable(msg.data, Command)
        if cmd.kind != "reload":
            return
        got.append(cmd)
        for rank, outcome in outcomes.items():
            await bus.publish_durable(s.ack(job, cmd.issuer), CommandAck(
                command_id=cmd.id, job=job, responder=f"rank-{rank}", kind=cmd.kind,
                outcome=outcome, detail="" if outcome == "done" else "no reload handler"))  # type: ignore[arg-type]

    await nc.subscribe(s.cmd_all(job), cb=cb)
    return got


async def world(redis_url: str, prefix: str, job: str, size: int) -> None:
    r = aioredis.Redis.from_url(redis_url)
    await r.set(Keys(prefix).progress(job), encode_progress(Progress(
        job=job, time=time.time(), incarnation=0, last_step=120, world_size=size)))
    await r.aclose()


async def rollback_stage(nc: Any, redis_url: str, prefix: str, job: str,
                         outcomes: dict[int, str]
                         ) -> tuple[Any, list[Incident], list[Command], list[RollbackRequest]]:
    """Two agents, a 2-rank job, a coordinator that rolls back, ranks answering reload."""
    agents, seen = await stage(nc, redis_url, prefix, job)
    await world(redis_url, prefix, job, 2)
    rollbacks = await answer_rollback(nc, Subjects(prefix), job)
    reloads = await ranks_answering_reload(nc, Subjects(prefix), job, outcomes)
    return agents, seen, reloads, rollbacks


async def test_a_rollback_reloads_in_place_on_every_rank(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any, tmp_path: Path) -> None:
    agents, seen, reloads, rollbacks = await rollback_stage(nc, redis_url, prefix, job,
                                                            {0: "done", 1: "done"})
    s = Subjects(prefix)
    async with leading(nats_url, redis_url, prefix, tmp_path, "ack_timeout_s = 10"):
        bus = Bus(nc, s, source="test")
        await bus.publish_durable(s.event(job, "diagnosis"),
                                  diagnosis(job, "d1", "numeric", host="node-a"))
        await wait_until(lambda: any(i.mitigated_at for i in seen), timeout=30,
                         what="mitigated")
        await bus.publish_durable(s.recovery(job, 0), recovered(
            job, "rb", kind="rollback", resumed=101, lost=20))
        await seed(redis_url, prefix, job, attempt=0, step=121)
        await wait_until(lambda: any(i.status == "resolved" for i in seen), timeout=30,
                         what="resolved")
    assert [(c.params, c.target, c.seq > 0) for c in reloads] == [
        ({"step": 100, "path": "/ckpt/step-100", "below": 120}, "all", True)]  # below: the onset
    final = seen[-1]
    assert [(a.action, a.status) for a in final.actions] == [("rollback", "done"),
                                                            ("restart", "skipped")]
    assert "every rank (2) reloaded in place" in final.actions[0].detail
    assert "no process restarted" in final.actions[1].detail
    assert [c.kind for c in agents.commands] == ["reload"]  # agents ignore it
    assert agents.executed("restart") == set()
    assert final.recovery is not None and final.recovery.kind == "rollback"
    assert (final.steps_lost, final.resume_step) == (20, 101)
    assert len(rollbacks) == 1


def restarted(seen: list[Incident]) -> list[Incident]:
    return [i for i in seen if i.actions and (i.actions[-1].action, i.actions[-1].status)
            == ("restart", "done")]


async def test_a_rank_without_reload_leaves_the_rollback_to_a_restart(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any, tmp_path: Path) -> None:
    agents, seen, _, rollbacks = await rollback_stage(nc, redis_url, prefix, job,
                                                      {0: "done", 1: "failed"})
    s = Subjects(prefix)
    async with leading(nats_url, redis_url, prefix, tmp_path, "ack_timeout_s = 10"):
        bus = Bus(nc, s, source="test")
        await bus.publish_durable(s.event(job, "diagnosis"),
                                  diagnosis(job, "d1", "numeric", host="node-a"))
        await wait_until(lambda: restarted(seen), timeout=30, what="the restart done")
    rollback = restarted(seen)[-1].actions[0]
    assert "rank-1: failed no reload handler" in rollback.detail
    assert len(agents.executed("restart")) == 1
    # One rollback: what the job saved of its bad state while the reload was tried is
    # suspect by its state_since, so a second one would only hit a fresh group's saves.
    assert len(rollbacks) == 1
