"""No poison pill (issue 13, item 3), on real servers: a message just under the streams'
1 MiB limit on every durable subject stops no consumer.

Before, one such message on ``event.anomaly`` ended the durable consumers of three
services for good: the dead letter carried the payload whole in base64, was over the
server's ``max_payload``, and the exception ended the consumer's task while ``/livez``
said 200. Here every service, the agent's command loop and the trainer client meet such a
message on each subject they consume, then a good one, which they must handle; each
consumer's letter arrives truncated, with the whole payload's size and hash.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import time
from pathlib import Path
from typing import Any

from tests.conftest import wait_until
from tests.integration.recorder import running
from tests.integration.test_client import make_guard
from tests.integration.test_service import MIB, big_diagnosis, collect_dead, errors, http_get
from tests.tap import tapped
from trainguard.agent.link import AgentLink, consumer_spec
from trainguard.agent.node import LocalNode
from trainguard.agent.settings import AgentSettings
from trainguard.client.transport import Transport
from trainguard.contract.codec import decode_durable
from trainguard.contract.envelope import H_TYPE
from trainguard.contract.schemas import (
    Action,
    Anomaly,
    CheckpointCommitted,
    CheckpointReport,
    Command,
    CommandAck,
    DeadLetter,
    Diagnosis,
    Durable,
    Incident,
    NodeHello,
    RankHello,
    WorkerExit,
)
from trainguard.contract.subjects import Subjects
from trainguard.runtime.bus import Bus
from trainguard.runtime.config import load_settings
from trainguard.runtime.deadletter import KEEP_WHOLE
from trainguard.runtime.service import Runtime
from trainguard.runtime.topology import stream_name
from trainguard.services.checkpointer.service import CheckpointerService
from trainguard.services.checkpointer.settings import CheckpointerSettings
from trainguard.services.detector.service import DetectorService
from trainguard.services.detector.settings import DetectorSettings
from trainguard.services.diagnoser.service import DiagnoserService
from trainguard.services.diagnoser.settings import DiagnoserSettings
from trainguard.services.remediator.service import RemediatorService
from trainguard.services.remediator.settings import RemediatorSettings

WAIT = 60.0
"""Generous: four services share two busy cores with the servers."""

POISON = b'{"pad": "' + b"x" * (MIB - 2048) + b'"}'
"""JSON, so it is read to the end, but no message's schema; just under 1 MiB, so the
streams take it (with its headers it is within the server's max_payload)."""
SHA = hashlib.sha256(POISON).hexdigest()


def check_letter(letter: DeadLetter, deliveries: int = 1) -> None:
    """The letter of a poison message: a head of it, with the whole one's size and hash;
    dead-lettered on its first delivery (core NATS counts none)."""
    assert letter.truncated and letter.size == len(POISON) and letter.sha256 == SHA
    assert len(letter.payload) == KEEP_WHOLE and POISON.startswith(letter.payload)
    assert letter.deliveries == deliveries, letter


async def poison(nc: Any, subject: str, cls: type[Durable]) -> None:
    await nc.jetstream().publish(subject, POISON, headers={H_TYPE: cls.ce_type()})


def acked(rt: Runtime, consumer: str) -> float:
    return rt.metrics.registry.get_sample_value("trainguard_messages_total", {
        "service": rt.service.name, "consumer": consumer, "outcome": "ack"}) or 0.0


def services(nats_url: str, redis_url: str, prefix: str) -> list[Any]:
    base = {"nats_url": nats_url, "redis_url": redis_url, "prefix": prefix}
    return [
        DetectorService(load_settings(DetectorSettings, env={}, overrides={
            **base, "tick_interval": 0.2, "lease_interval": 0.2, "lease_ttl": 1.5})),
        DiagnoserService(load_settings(DiagnoserSettings, env={}, overrides=base)),
        RemediatorService(load_settings(RemediatorSettings, env={},
                                        overrides={**base, "lease_ttl": 1.0})),
        CheckpointerService(load_settings(CheckpointerSettings, env={},
                                          overrides={**base, "tick": 0.2})),
    ]


async def test_a_near_1mib_message_on_every_durable_subject_stops_no_service(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any,
        tmp_path: Path) -> None:
    s = Subjects(prefix)
    dead = await collect_dead(nc, prefix, job)
    svcs = services(nats_url, redis_url, prefix)
    async with contextlib.AsyncExitStack() as stack:
        rts = {svc.name: await stack.enter_async_context(running(svc)) for svc in svcs}

        async def all_ready() -> bool:
            return all([(await rt.ready())[0] for rt in rts.values()])

        # Consumers of new messages only must exist before the poison is sent.
        await wait_until(all_ready, timeout=WAIT, what="every service ready")
        subjects: list[tuple[str, type[Durable]]] = [
            *((s.event(job, k), c) for k, c in (
                ("anomaly", Anomaly), ("diagnosis", Diagnosis), ("action", Action),
                ("incident", Incident), ("checkpoint", CheckpointCommitted))),
            (s.exit(job, "node-a"), WorkerExit), (s.ckpt(job, 0), CheckpointReport),
            (s.reg_rank(job, 0), RankHello), (s.reg_node(job, "node-a"), NodeHello),
            (s.ack(job, "remediator"), CommandAck),
        ]
        for subject, cls in subjects:
            await poison(nc, subject, cls)
        await nc.publish(s.gpu(job, "node-a"), POISON)  # and telemetry, to the diagnoser
        want = {  # subject -> the (service, consumer) pairs that consume it durably
            s.event(job, "anomaly"): {("diagnoser", "diagnoser"),
                                      ("remediator", "remediator-anomalies"),
                                      ("checkpointer", "checkpointer-events")},
            s.event(job, "diagnosis"): {("remediator", "remediator")},
            s.event(job, "incident"): {("checkpointer", "checkpointer-events")},
            s.exit(job, "node-a"): {("detector", "detector-exit"),
                                    ("diagnoser", "diagnoser-exits")},
            s.ckpt(job, 0): {("detector", "detector-ckpt"), ("checkpointer", "checkpointer")},
            s.reg_rank(job, 0): {("detector", "detector-reg")},
            s.reg_node(job, "node-a"): {("detector", "detector-reg")},
        }

        def letters() -> dict[str, set[tuple[str, str]]]:
            got: dict[str, set[tuple[str, str]]] = {}
            for d in dead:
                got.setdefault(d.subject, set()).add((d.service, d.consumer))
            return got

        core = {s.gpu(job, "node-a"): {("diagnoser", "telemetry")},  # core subscriptions
                s.ack(job, "remediator"): {("remediator", "acks")}}
        letters_wanted = {**want, **core}
        await wait_until(lambda: all(letters().get(k, set()) >= v
                                     for k, v in letters_wanted.items()),
                         timeout=WAIT, what="a letter from every consumer of every subject")
        for letter in dead:
            if letter.consumer == "telemetry":
                assert letter.reason == f"oversized telemetry: {len(POISON)} bytes exceeds " \
                                        "the 65536-byte limit"
            check_letter(letter, 0 if letter.consumer in ("telemetry", "acks") else 1)

        # Then a good message on each subject: every consumer handles it.
        bus = Bus(nc, s, source="test")
        now = time.time()
        await bus.publish_durable(s.event(job, "anomaly"), Anomaly(
            id="a-good", job=job, kind="hang", ranks=[0], onset_at=now, detected_at=now))
        await bus.publish_durable(s.event(job, "diagnosis"), Diagnosis(
            id="d-good", job=job, anomaly_ids=["a-good"], cause="unknown", confidence=0.2,
            ranks=[0], hosts=["node-a"], time=now))
        await bus.publish_durable(s.event(job, "incident"), Incident(
            id="i-good", job=job, cause="unknown"))
        await bus.publish_durable(s.exit(job, "node-a"), WorkerExit(
            id="x-good", job=job, host="node-a", rank=0, exit_code=1, time=now))
        await bus.publish_durable(s.ckpt(job, 0), CheckpointReport(
            id="k-good", job=job, rank=0, step=10, path=str(tmp_path / job / "step-10"),
            world_size=2, time=now))
        await bus.publish_durable(s.reg_rank(job, 0), RankHello(
            job=job, rank=0, world_size=2, host="node-a", time=now))
        await bus.publish_durable(s.reg_node(job, "node-a"), NodeHello(
            job=job, host="node-a", local_ranks=[0], time=now))
        await bus.publish_durable(s.ack(job, "remediator"), CommandAck(
            command_id="c-good", job=job, responder="host-node-a", outcome="done"))
        handled = {("detector", "detector-reg"): 2}  # both hellos; every other consumer: 1
        for pairs in want.values():
            for pair in pairs:
                handled.setdefault(pair, 1)
        for (name, consumer), n in handled.items():
            await wait_until(lambda name=name, consumer=consumer, n=n:
                             acked(rts[name], consumer) >= n, timeout=WAIT,
                             what=f"{name}/{consumer} to handle a good message")
        remediator = next(svc for svc in svcs if svc.name == "remediator")
        # The acks' core subscription went on too (the box keeps acks until collected).
        assert await remediator._acks.collect("c-good", {"node-a"}, WAIT)

        js = nc.jetstream()

        async def nothing_left() -> bool:  # a restart would meet no poison again
            for stream in ("events", "reports"):
                for info in await js.consumers_info(stream_name(prefix, stream)):
                    if info.num_ack_pending or info.num_pending:
                        return False
            return True

        await wait_until(nothing_left, timeout=WAIT, what="every consumer settled")
        for rt in rts.values():
            assert rt.live() is None
            assert await http_get(rt, "/livez") == (200, "ok\n")
        refused = collections.Counter(pair for pairs in want.values() for pair in pairs)
        for (name, consumer), n in refused.items():  # each consumer counted what it refused
            assert errors(rts[name], consumer, "malformed") == n, (name, consumer)
        assert errors(rts["diagnoser"], "telemetry", "oversized") == 1
        assert errors(rts["remediator"], "acks", "malformed") == 1


async def test_the_agent_command_loop_survives_a_poison_command(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any) -> None:
    s = Subjects(prefix)
    settings = load_settings(AgentSettings, env={}, overrides={
        "nats_url": nats_url, "redis_url": redis_url, "prefix": prefix, "job": job,
        "host": "node-a", "node_interval": 0.5, "gpu_interval": 60.0})
    # The agent's real node, with no workers (no launcher here): a dump of no ranks.
    node = LocalNode(settings, hosts_store=False, gpu=None, publish_exit=lambda _: None)
    link = AgentLink(settings, node, NodeHello(job=job, host="node-a"))
    dead = await collect_dead(nc, prefix, job)
    acks: list[CommandAck] = []

    async def on_ack(msg: Any) -> None:
        acks.append(decode_durable(msg.data, CommandAck))

    await nc.subscribe(s.ack(job, "cli"), cb=on_ack)
    link.start()
    try:
        assert await asyncio.to_thread(link.ready.wait, WAIT), "agent link not ready"
        for subject in (s.cmd_all(job), s.cmd_host(job, "node-a")):
            await poison(nc, subject, Command)
        await wait_until(lambda: len(dead) == 2, timeout=WAIT, what="two letters")
        durable = consumer_spec(settings).durable
        for letter in dead:
            check_letter(letter)
            assert (letter.service, letter.consumer) == ("agent", durable)
        assert link.command_errors == {"malformed": 2}
        await Bus(nc, s, source="test").publish_durable(s.cmd_host(job, "node-a"), Command(
            id="c-after", job=job, kind="dump", issuer="cli", target="host.node-a",
            params={"ranks": []}))
        await wait_until(lambda: [a.command_id for a in acks] == ["c-after"], timeout=WAIT,
                         what="the next command run and acknowledged")
        assert acks[0].outcome == "done"
    finally:
        await asyncio.to_thread(link.close, 10.0)


async def test_ranks_survive_a_poison_command(nats_url: str, prefix: str, job: str) -> None:
    s = Subjects(prefix)
    async with tapped(nats_url, prefix, job) as (tap, bus):
        guard = make_guard(nats_url, prefix, job)
        ran: list[str] = []
        guard.on("note", lambda cmd: ran.append(cmd.id) or "noted")
        guard.start()
        await wait_until(lambda: guard.connected, timeout=WAIT, what="guard connected")
        for subject in (s.cmd_all(job), s.cmd_rank(job, 0)):
            await poison(bus.nc, subject, Command)
        await bus.publish_durable(s.cmd_rank(job, 0), Command(
            id="c-after", job=job, kind="note", issuer="cli", target="rank.0"))

        def safe_point() -> None:  # commands run on the training thread, at a step
            with guard.step(0):
                pass

        async def at_safe_points() -> bool:
            await asyncio.to_thread(safe_point)
            return "c-after" in {a.command_id for a in tap.acks}

        await wait_until(at_safe_points, timeout=WAIT, what="the next command run")
        assert ran == ["c-after"] and guard.stats()["connected"]
        guard.close()


async def test_the_client_transport_isolates_callbacks_and_drops_what_never_fits(
        nats_url: str, prefix: str, job: str) -> None:
    s = Subjects(prefix)
    async with tapped(nats_url, prefix, job) as (tap, bus):
        t = Transport(nats_url, name="poison-test", source="test")
        got: list[bytes] = []

        def cb(msg: Any) -> None:
            if msg.data == b"boom":
                raise RuntimeError("boom")
            got.append(msg.data)

        t.subscribe(s.cmd_all(job), cb)
        t.start()
        try:
            await wait_until(lambda: t.connected, timeout=WAIT, what="transport connected")
            await bus.nc.publish(s.cmd_all(job), b"boom")
            await bus.nc.publish(s.cmd_all(job), b"fine")
            await wait_until(lambda: got == [b"fine"], timeout=WAIT, what="the next message")
            assert t.stats.callback_errors == 1
            # A durable message over the limit is dropped, counted, and stalls nothing.
            t.publish_durable(s.event(job, "diagnosis"), big_diagnosis(job, MIB - 50))
            t.publish_durable(s.ack(job, "cli"), CommandAck(
                command_id="c-1", job=job, responder="rank-0", outcome="done"))
            await wait_until(lambda: tap.acks, timeout=WAIT, what="the next durable message")
            assert (t.stats.durable_refused, t.stats.durable_dropped) == (1, 1)
            assert t.connected
        finally:
            await asyncio.to_thread(t.close)

