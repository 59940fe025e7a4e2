"""The JetStream behaviour trainguard relies on, checked against the real server."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from typing import Any

import pytest
from nats.js import api

from tests.conftest import wait_until
from trainguard.contract.schemas import Command
from trainguard.contract.subjects import Subjects
from trainguard.runtime.bus import UNACKED_PUBLISH_ERRORS, Bus
from trainguard.runtime.topology import (
    ConsumerSpec,
    ensure_consumer,
    provision,
    stream_name,
    streams,
)


async def test_provisioning_is_idempotent_and_updates_changed_streams(nc: Any,
                                                                      prefix: str) -> None:
    js = nc.jetstream()
    created = await provision(js, streams(prefix))
    assert created == [f"created {stream_name(prefix, r)}"
                       for r in ("events", "cmds", "reports", "dead")]
    assert await provision(js, streams(prefix)) == []
    info = await js.stream_info(stream_name(prefix, "cmds"))
    assert info.config.retention == api.RetentionPolicy.INTEREST
    # A deployment that changed a limit gets it applied, not an error 10058.
    changed = [s for s in streams(prefix)]
    changed[0] = dataclasses.replace(changed[0], max_age=3600.0)
    assert await provision(js, changed) == [f"updated {stream_name(prefix, 'events')}"]
    assert (await js.stream_info(stream_name(prefix, "events"))).config.max_age == 3600.0


async def test_same_message_id_is_stored_once(nc: Any, prefix: str, job: str) -> None:
    js = nc.jetstream()
    await provision(js, streams(prefix))
    subject = Subjects(prefix).event(job, "anomaly")
    first = await js.publish(subject, b"{}", headers={"Nats-Msg-Id": "same"})
    again = await js.publish(subject, b"{}", headers={"Nats-Msg-Id": "same"})
    assert not first.duplicate and again.duplicate
    info = await js.stream_info(stream_name(prefix, "events"))
    assert info.state.messages == 1


async def test_broadcast_command_reaches_every_bound_consumer(nc: Any, prefix: str,
                                                              job: str) -> None:
    s = Subjects(prefix)
    js = nc.jetstream()
    await provision(js, streams(prefix))
    subs = []
    for host in ("node-a", "node-b"):
        spec = ConsumerSpec("cmds", f"agent-{host}", (s.cmd_all(job), s.cmd_host(job, host)))
        stream = await ensure_consumer(js, prefix, spec)
        subs.append(await js.pull_subscribe_bind(spec.durable, stream))
    bus = Bus(nc, s, source="test")
    await bus.publish_durable(s.cmd_all(job), Command(id="c1", job=job, kind="restart",
                                                      issuer="cli"))
    await bus.publish_durable(s.cmd_host(job, "node-b"),
                              Command(id="c2", job=job, kind="isolate", issuer="cli"))
    got = []
    for sub in subs:
        msgs = await sub.fetch(10, timeout=2)
        got.append(sorted(json.loads(m.data)["id"] for m in msgs))
        for m in msgs:
            await m.ack()
    assert got == [["c1"], ["c1", "c2"]]


async def test_max_deliveries_advisory_is_captured_in_the_dead_stream(nc: Any, prefix: str,
                                                                      job: str) -> None:
    js = nc.jetstream()
    await provision(js, streams(prefix))
    s = Subjects(prefix)
    events = stream_name(prefix, "events")
    await js.add_consumer(events, api.ConsumerConfig(
        durable_name="stubborn", ack_policy=api.AckPolicy.EXPLICIT, max_deliver=2,
        ack_wait=0.3, filter_subject=s.event(job, "anomaly")))
    sub = await js.pull_subscribe_bind("stubborn", events)
    await js.publish(s.event(job, "anomaly"), b"{}")
    dead = stream_name(prefix, "dead")

    async def advisory_stored() -> bool:
        # The advisory fires lazily, on the next delivery attempt: keep fetching.
        with contextlib.suppress(Exception):
            await sub.fetch(1, timeout=0.5)
        return (await js.stream_info(dead)).state.messages >= 1

    await wait_until(advisory_stored, timeout=20, what="MAX_DELIVERIES advisory")
    msg = await js.get_last_msg(dead, f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{events}.*")
    assert json.loads(msg.data)["consumer"] == "stubborn"


@pytest.mark.parametrize(("prefix_value", "base"), [("tg", "TG"), ("prod.tg", "PROD_TG"),
                                                    ("a-b", "A_B")])
def test_stream_names_follow_the_prefix(prefix_value: str, base: str) -> None:
    names = [spec.name for spec in streams(prefix_value)]
    assert names == [f"{base}_{r}" for r in ("EVENTS", "CMDS", "REPORTS", "DEAD")]


async def test_a_publish_without_ack_is_retried_until_the_stream_answers(
        nc: Any, prefix: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """No stream answers at first (as while its leader is elected): the publish waits for
    it within ``retry_for``, then lands once; without ``retry_for`` it fails at once."""
    bus = Bus(nc, Subjects(prefix), source="test")
    subject = Subjects(prefix).cmd_all(job)
    cmd = Command(id="c1", job=job, kind="save_now", issuer="test")
    with pytest.raises(UNACKED_PUBLISH_ERRORS):
        await bus.publish_durable(subject, cmd, timeout=0.5)
    publishing = asyncio.create_task(bus.publish_durable(subject, cmd, timeout=0.5,
                                                         retry_for=60.0))
    await wait_until(lambda: "got no ack" in caplog.text, timeout=10,
                     what="a publish that got no ack")
    await provision(nc.jetstream(), streams(prefix))
    ack = await asyncio.wait_for(publishing, 60)
    assert ack.stream == stream_name(prefix, "cmds") and not ack.duplicate
    # Interest retention drops it at once (no consumer): its sequence says it landed once.
    assert (await nc.jetstream().stream_info(stream_name(prefix, "cmds"))).state.last_seq == 1
