"""One decision that reaches every agent of a large job, on real NATS and Redis: the
remediator's view reads every host's node record (more than one batch of them), the
group's restart goes out once to ``cmd.all``, every agent's ack is collected, and the
step's detail counts them instead of growing with the job."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import redis.asyncio as aioredis

from tests.conftest import wait_until
from tests.integration.test_remediator_service import incidents_of, leading
from trainguard.contract.codec import decode_durable
from trainguard.contract.schemas import Command, CommandAck, Diagnosis
from trainguard.contract.subjects import Subjects
from trainguard.runtime.bus import Bus
from trainguard.runtime.state import Keys, NodeRecord, Progress, encode_node_record, encode_progress
from trainguard.runtime.topology import provision, streams

HOSTS = 1_500
"""More hosts than one read of node records takes (``store.READ_BATCH``)."""


async def seed_hosts(redis_url: str, prefix: str, job: str) -> list[str]:
    keys, hosts = Keys(prefix), [f"node-{h}" for h in range(HOSTS)]
    r = aioredis.Redis.from_url(redis_url)
    async with r.pipeline(transaction=False) as pipe:
        for host in hosts:
            pipe.set(keys.node(job, host), encode_node_record(NodeRecord(
                host=host, job=job, hosts_store=host == "node-0", nnodes_min=1)))
        pipe.set(keys.progress(job), encode_progress(Progress(
            job=job, time=time.time(), incarnation=0, last_step=120)))
        await pipe.execute()
    await r.aclose()
    return hosts


async def test_a_group_restart_reaches_every_agent_and_collects_every_ack(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any) -> None:
    s = Subjects(prefix)
    await provision(nc.jetstream(), streams(prefix))
    hosts = await seed_hosts(redis_url, prefix, job)
    bus = Bus(nc, s, source="test-agents")
    commands: list[Command] = []

    async def agents(msg: Any) -> None:
        """Every host's agent answers the command, each on its own."""
        cmd = decode_durable(msg.data, Command)
        commands.append(cmd)
        await asyncio.gather(*(bus.publish_durable(s.ack(job, cmd.issuer), CommandAck(
            command_id=cmd.id, job=job, responder=f"host-{host}", outcome="done",
            kind=cmd.kind)) for host in hosts))

    await nc.subscribe(s.cmd_all(job), cb=agents)
    seen = await incidents_of(nc, prefix, job)
    async with leading(nats_url, redis_url, prefix):
        now = time.time()
        await bus.publish_durable(s.event(job, "diagnosis"), Diagnosis(
            id="d1", job=job, anomaly_ids=["a1"], cause="network", confidence=0.9,
            ranks=[8], hosts=["node-1"], step=120, time=now, summary="collective timed out"))
        await wait_until(lambda: any(st.status != "sent" and st.status != "pending"
                                     for i in seen for st in i.actions), timeout=60,
                         what="the restart judged")
    restart = next(st for i in seen for st in i.actions if st.status not in ("sent", "pending"))
    assert restart.action == "restart" and restart.status == "done"
    assert [c.target for c in commands] == ["all"] and len(restart.command_ids) == 1
    assert restart.detail == f"{HOSTS} of {HOSTS} agents answered: {HOSTS} done"
