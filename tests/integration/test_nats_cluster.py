"""Replicated streams on a real 3-node NATS cluster: losing a node loses nothing acknowledged.

Three routed nats-servers on loopback (``tests.ha``). The clients get every node's URL and
fail over between them; the streams and consumers have ``TRAINGUARD_STREAM_REPLICAS`` = 3
copies, so when the node that leads a stream dies its Raft group elects another leader and
every message the old leader acknowledged is still there.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from nats.js import api

from tests.conftest import wait_until
from tests.ha import NatsCluster
from trainguard.contract.errors import ConfigError
from trainguard.contract.schemas import Command
from trainguard.contract.subjects import Subjects
from trainguard.runtime.bus import Bus, connect_nats
from trainguard.runtime.fencing import Epochs
from trainguard.runtime.topology import (
    ConsumerSpec,
    ensure_consumer,
    provision,
    stream_name,
    streams,
)


async def test_provisioning_scales_existing_streams_to_the_replica_setting(
        ready_cluster: NatsCluster, prefix: str) -> None:
    nc = await connect_nats(ready_cluster.url, name="test")
    try:
        js = nc.jetstream(timeout=10.0)
        await provision(js, streams(prefix))  # a deployment that started with one copy
        events = stream_name(prefix, "events")
        assert (await js.stream_info(events)).config.num_replicas == 1
        changed = await provision(js, streams(prefix, replicas=3))
        assert changed == [f"updated {spec.name}" for spec in streams(prefix)]
        for spec in streams(prefix):
            info = await js.stream_info(spec.name)
            assert info.config.num_replicas == 3
            assert info.cluster is not None
            await wait_until(lambda n=spec.name: _replicas_current(js, n), timeout=30,
                             what=f"{spec.name} replicas caught up")
        assert await provision(js, streams(prefix, replicas=3)) == []
        spec = ConsumerSpec("events", "svc", (Subjects(prefix).pattern("event", tail=">"),))
        await ensure_consumer(js, prefix, spec, replicas=3)
        assert (await js.consumer_info(events, "svc")).config.num_replicas == 3
        agent = ConsumerSpec("cmds", "agent-a", (Subjects(prefix).cmd_all("j"),))
        cmds = await ensure_consumer(js, prefix, agent)  # an agent: the stream's count
        assert (await js.consumer_info(cmds, "agent-a")).config.num_replicas == 3
    finally:
        await nc.close()


async def _replicas_current(js: Any, name: str) -> bool:
    info = await js.stream_info(name)
    replicas = info.cluster.replicas or []
    return len(replicas) == 2 and all(r.current for r in replicas)


async def test_more_replicas_than_servers_is_a_clear_config_error(nats_url: str,
                                                                  prefix: str) -> None:
    nc = await connect_nats(nats_url, name="test")
    try:
        with pytest.raises(ConfigError, match="TRAINGUARD_STREAM_REPLICAS=3 needs a JetStream "
                                              "cluster"):
            await provision(nc.jetstream(), streams(prefix, replicas=3))
    finally:
        await nc.close()


async def test_killing_the_stream_leader_loses_no_acknowledged_message(
        ready_cluster: NatsCluster, prefix: str, job: str) -> None:
    """Publish and consume across the death of the node that leads the command stream:
    every acknowledged publish is delivered, exactly once after dedupe, and the client
    fails over to the surviving nodes by itself."""
    s = Subjects(prefix)
    nc = await connect_nats(ready_cluster.url, name="test")
    try:
        js = nc.jetstream(timeout=10.0)
        await provision(js, streams(prefix, replicas=3))
        spec = ConsumerSpec("cmds", "agent-a", (s.cmd_all(job),))
        stream = await ensure_consumer(js, prefix, spec, replicas=3)
        sub = await js.pull_subscribe_bind(spec.durable, stream)
        bus = Bus(nc, s, source="test")
        acked: list[str] = []

        async def publish(n: int) -> None:
            for i in range(n):
                cid = f"c{len(acked)}-{i}"
                deadline = time.monotonic() + 60
                while True:  # a sender retries until the stream acknowledges
                    try:
                        await bus.publish_durable(s.cmd_all(job), Command(
                            id=cid, job=job, kind="restart", issuer="cli"), timeout=2.0)
                        break
                    except Exception:
                        assert time.monotonic() < deadline, "stream never came back"
                acked.append(cid)

        await publish(20)
        leader = await ready_cluster.leader_of(stream, nc)
        leader.kill()
        killed = time.monotonic()
        await publish(1)
        back = time.monotonic() - killed
        await publish(19)
        seen: list[str] = []

        async def drained() -> bool:
            try:
                for msg in await sub.fetch(50, timeout=1.0):
                    seen.append(_id_of(msg.data))
                    await msg.ack()
            except Exception:
                pass
            return set(seen) >= set(acked)

        await wait_until(drained, timeout=60, what="every acknowledged command delivered")
        assert sorted(set(seen)) == sorted(acked)
        new_leader = await ready_cluster.leader_of(stream, nc)
        assert new_leader is not leader
        assert nc.connected_url is not None and nc.connected_url.port != leader.port
        print(f"stream leader killed: {len(acked)} acknowledged, {len(set(acked) - set(seen))} "
              f"lost; publishes acknowledged again after {back:.1f}s")
    finally:
        await nc.close()


def _id_of(data: bytes) -> str:
    import msgspec

    return str(msgspec.json.decode(data)["id"])


async def test_fencing_epochs_survive_the_loss_of_the_bucket_leader(
        ready_cluster: NatsCluster, prefix: str) -> None:
    """The bucket behind the fencing epochs is replicated too: after its leader dies the
    next epoch is still above every one drawn before."""
    nc = await connect_nats(ready_cluster.url, name="test")
    try:
        epochs = Epochs(nc.jetstream(timeout=10.0), prefix, replicas=3)
        drawn = [await epochs.draw("remediator") for _ in range(5)]
        assert drawn == sorted(set(drawn))
        kv_stream = f"KV_{epochs.bucket}"
        info = await nc.jetstream().stream_info(kv_stream)
        assert info.config.num_replicas == 3
        (await ready_cluster.leader_of(kv_stream, nc)).kill()

        async def draw() -> int | None:
            try:
                return await epochs.draw("remediator")
            except Exception:
                return None

        after = await wait_until(draw, timeout=60, what="an epoch from the new bucket leader")
        assert after > max(drawn)
    finally:
        await nc.close()


def test_stream_config_carries_replicas(prefix: str) -> None:
    assert {spec.config().num_replicas for spec in streams(prefix, replicas=3)} == {3}
    assert ConsumerSpec("events", "x", ("a",)).config(3).num_replicas == 3
    assert streams(prefix)[0].config().retention == api.RetentionPolicy.LIMITS
