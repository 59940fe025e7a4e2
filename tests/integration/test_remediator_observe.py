"""Observe-only on real NATS and Redis: a job in observe mode gets its incident, with every
step recorded as ``observed`` ("would have ..."), and no command, no blocklist entry;
``trainguard act`` on the running remediator makes the next incident act, no restart."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from tests.conftest import wait_until
from tests.integration.test_remediator_service import diagnosis, leading, seed, stage
from trainguard.cli import main
from trainguard.contract.codec import decode_durable
from trainguard.contract.schemas import Action, Command, Incident
from trainguard.contract.subjects import Subjects
from trainguard.core.connection import flush
from trainguard.runtime.bus import Bus
from trainguard.runtime.state import Keys


async def cli(*argv: str) -> int:
    """``trainguard ARGV`` as an operator runs it (its own event loop, in a thread)."""
    return await asyncio.to_thread(main, list(argv))


async def test_an_observed_job_is_paged_would_have_and_commanded_nothing_until_it_acts(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any, tmp_path: Path,
        capsys: Any) -> None:
    agents, seen = await stage(nc, redis_url, prefix, job)
    s = Subjects(prefix)
    commands: list[Command] = []  # anything on the job's command subjects, whoever it is for
    actions: list[Action] = []

    async def on_command(msg: Any) -> None:
        commands.append(decode_durable(msg.data, Command))

    async def on_action(msg: Any) -> None:
        actions.append(decode_durable(msg.data, Action))

    await nc.subscribe(f"{s.cmd_all(job).rsplit('.', 1)[0]}.>", cb=on_command)
    await nc.subscribe(s.event(job, "action"), cb=on_action)
    conn = ("--redis", redis_url, "--prefix", prefix)
    assert await cli("observe", job, *conn) == 0
    assert await cli("observe", "--show", job, *conn) == 0
    assert "observe: dump, hold, isolate, restart, rollback, save_now" in capsys.readouterr().out

    async with leading(nats_url, redis_url, prefix, tmp_path, "launcher_grace_s = 0") as svc:
        bus = Bus(nc, s, source="test")
        await bus.publish_durable(s.event(job, "diagnosis"), diagnosis(job, "d1", "hbm_ecc"))
        first = await wait_until(lambda: next((i for i in seen if i.mitigated_at), None),
                                 what="the plan recorded")
        # Acting, the isolate and the restart went out before this revision was saved.
        await flush(nc)
        assert commands == [] and agents.commands == []
        assert [(a.action, a.status) for a in first.actions] == [("isolate", "observed"),
                                                                  ("restart", "observed")]
        assert first.actions[0].detail.startswith("would have isolated node-b")
        assert first.actions[1].detail.startswith("would have sent restart to every host")
        assert first.status == "mitigating" and first.restarted_attempt is None
        r = aioredis.Redis.from_url(redis_url)
        assert await r.hget(Keys(prefix).blocklist(), "node-b") is None
        await r.aclose()
        await wait_until(lambda: len(actions) >= 2, what="the actions announced")
        assert [a.status for a in actions] == ["observed", "observed"]
        # Nobody restarted it: it ends when training gets past the failure by itself.
        await seed(redis_url, prefix, job, attempt=1, step=121)
        await wait_until(lambda: any(i.id == first.id and i.status == "resolved"
                                     for i in seen), what="resolved on its own")

        # Switched on the running remediator: the next incident acts.
        assert await cli("act", job, *conn) == 0
        await bus.publish_durable(s.event(job, "diagnosis"),
                                  diagnosis(job, "d2", "network", step=130))
        await wait_until(lambda: any(c.kind == "restart" for c in commands),
                         what="the restart sent")
        second = await wait_until(lambda: next((i for i in seen if i.id != first.id
                                                and i.mitigated_at), None), what="mitigated")
        assert svc.leader is not None and svc.leader.leading
    assert [(a.action, a.status) for a in second.actions] == [("restart", "done")]
    assert [c.kind for c in agents.commands] == ["restart"]


async def test_per_action_observe_acts_on_the_rest(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any, tmp_path: Path) -> None:
    """``--actions isolate``: the isolation is observed, the restart is carried out."""
    agents, seen = await stage(nc, redis_url, prefix, job)
    conn = ("--redis", redis_url, "--prefix", prefix)
    assert await cli("observe", job, "--actions", "isolate", *conn) == 0
    async with leading(nats_url, redis_url, prefix, tmp_path, "launcher_grace_s = 0"):
        bus = Bus(nc, Subjects(prefix), source="test")
        await bus.publish_durable(Subjects(prefix).event(job, "diagnosis"),
                                  diagnosis(job, "d1", "hbm_ecc"))
        final: Incident = await wait_until(
            lambda: next((i for i in seen if i.mitigated_at), None), what="mitigated")
    assert [(a.action, a.status) for a in final.actions] == [("isolate", "observed"),
                                                              ("restart", "done")]
    assert [c.kind for c in agents.commands] == ["restart"]
