"""Access control on real servers: what a client with the wrong role (or none) cannot do.

The control plane here runs with auth on, as ``trainguard up`` does by default: every role
has its own NATS user and Redis ACL user, rendered from ``trainguard.core.auth``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats
import nats.js.errors
import pytest
import redis.asyncio as aioredis
from nats.aio.client import Client as NATS
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from tests.conftest import wait_until
from trainguard.contract.codec import encode_durable
from trainguard.contract.subjects import Subjects
from trainguard.contract.targets import addressed
from trainguard.core.auth import Role, load_credentials
from trainguard.core.connection import flush
from trainguard.runtime.embedded import EmbeddedControlPlane

S = Subjects()


@pytest.fixture(scope="module")
def secure_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedControlPlane]:
    plane = EmbeddedControlPlane(tmp_path_factory.mktemp("secure"), secure=True)
    plane.start()
    try:
        yield plane
    finally:
        plane.stop()


class Client:
    """A NATS connection as one role, recording the server's permission errors."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc: Any = None

    async def connect(self, plane: EmbeddedControlPlane, role: Role) -> Client:
        creds = load_credentials(plane.credentials[role])
        assert creds.nats is not None

        async def on_error(exc: Exception) -> None:
            self.errors.append(str(exc))

        self.nc = await nats.connect(plane.nats.url, user=creds.nats.user,
                                     password=creds.nats.password, error_cb=on_error,
                                     max_reconnect_attempts=0)
        return self


@pytest.fixture
async def connect(secure_plane: EmbeddedControlPlane) -> AsyncIterator[Any]:
    clients: list[Client] = []

    async def _connect(role: Role) -> Client:
        client = await Client().connect(secure_plane, role)
        clients.append(client)
        return client

    yield _connect
    for c in clients:
        await c.nc.close()


def _redis(plane: EmbeddedControlPlane, role: Role | None) -> aioredis.Redis:
    if role is None:
        return aioredis.Redis(host="127.0.0.1", port=plane.redis.port)
    creds = load_credentials(plane.credentials[role])
    assert creds.redis is not None
    return aioredis.Redis(host="127.0.0.1", port=plane.redis.port, username=creds.redis.user,
                          password=creds.redis.password)


async def test_a_forged_command_never_reaches_a_receiver(connect: Any, job: str) -> None:
    agent = await connect("agent")
    got: list[str] = []

    async def on_cmd(msg: Any) -> None:
        got.append(msg.subject)

    await agent.nc.subscribe(S.cmd_all(job), cb=on_cmd)
    await flush(agent.nc)
    for forger in ("rank", "oncall", "agent", "detector", "diagnoser"):
        client = await connect(forger)
        subject, cmd = addressed(S, job, "restart", issuer="remediator", everyone=True,
                                 epoch=2**53)
        await client.nc.publish(subject, encode_durable(cmd))
        await flush(client.nc)
        await wait_until(lambda c=client: any("permissions violation" in e.lower()
                                              for e in c.errors),
                         what=f"the server refusing {forger}'s command")
    leader = await connect("remediator")
    subject, cmd = addressed(S, job, "restart", issuer="remediator", everyone=True)
    await leader.nc.publish(subject, encode_durable(cmd))
    await wait_until(lambda: got, what="the remediator's command")
    assert got == [subject]  # the forged ones were dropped by the server


@pytest.mark.parametrize("forger", ["rank", "agent", "oncall"])
async def test_no_client_but_the_coordinator_answers_or_rolls_back(connect: Any, job: str,
                                                                   forger: Role) -> None:
    client = await connect(forger)
    # A fake coordinator: subscribing to the endpoints is refused.
    await client.nc.subscribe(S.rpc_resume(job))
    await flush(client.nc)
    await wait_until(lambda: any("subscription" in e.lower() for e in client.errors),
                     what="the server refusing the fake coordinator")
    # Rolling back the resume pointer is not theirs to ask for.
    with pytest.raises((nats.errors.NoRespondersError, nats.errors.TimeoutError)):
        await client.nc.request(S.rpc_rollback(job), b'{"below_step": 1}', timeout=0.5)
    await wait_until(lambda: any("publish" in e.lower() for e in client.errors),
                     what="the server refusing the rollback request")


async def test_anonymous_clients_are_refused(secure_plane: EmbeddedControlPlane) -> None:
    nc = NATS()
    try:
        with pytest.raises(nats.errors.Error, match=r"(?i)authorization"):
            await nc.connect(secure_plane.nats.url, allow_reconnect=False, connect_timeout=2)
    finally:
        await nc.close()
    anonymous = _redis(secure_plane, None)
    try:
        with pytest.raises((AuthenticationError, ResponseError)):
            await anonymous.hset("tg:blocklist", "node-a", "{}")
    finally:
        await anonymous.aclose()


@pytest.mark.parametrize("role", ["agent", "oncall"])
async def test_only_the_remediator_writes_the_blocklist(secure_plane: EmbeddedControlPlane,
                                                        role: Role) -> None:
    client = _redis(secure_plane, role)
    try:
        with pytest.raises(NoPermissionError):
            await client.hset("tg:blocklist", "node-a", '{"reason": "forged"}')
        assert await client.hget("tg:blocklist", "node-a") is None  # reading is allowed
    finally:
        await client.aclose()
    remediator = _redis(secure_plane, "remediator")
    try:
        assert await remediator.hset("tg:blocklist", "node-z", "{}") == 1
        await remediator.hdel("tg:blocklist", "node-z")
    finally:
        await remediator.aclose()


async def test_the_agent_reads_redis_and_writes_nothing(
        secure_plane: EmbeddedControlPlane) -> None:
    """Not the fencing epoch (nor read it: its ceiling is the fence bucket's), the
    blocklist, nor its own node record (the remediator keeps that from the agent's
    hellos): a stolen agent credential cannot undo either guard."""
    remediator = _redis(secure_plane, "remediator")
    agent = _redis(secure_plane, "agent")
    epoch, node = "tg:epoch:remediator-test", "tg:node:job-x:node-a"
    try:
        await remediator.set(epoch, "7")
        await remediator.set(node, "{}")
        await remediator.hset("tg:blocklist", "node-y", '{"reason": "sick"}')
        assert await agent.hget("tg:blocklist", "node-y") is not None  # it reads that
        for write in (lambda: agent.get(epoch), lambda: agent.set(epoch, "0"),
                      lambda: agent.delete(epoch),
                      lambda: agent.delete("tg:blocklist"),
                      lambda: agent.set("tg:blocklist", "x"),
                      lambda: agent.set(node, "{}"), lambda: agent.delete(node)):
            with pytest.raises(NoPermissionError):
                await write()
        assert await remediator.get(epoch) == b"7" and await remediator.get(node) == b"{}"
        assert await remediator.hget("tg:blocklist", "node-y") is not None
    finally:
        await remediator.delete(epoch, node)
        await remediator.hdel("tg:blocklist", "node-y")
        await remediator.aclose()
        await agent.aclose()


async def test_the_operator_may_end_a_blocklist_entry_and_touch_nothing_else(
        secure_plane: EmbeddedControlPlane) -> None:
    """``trainguard unblock`` rewrites one entry (optimistically); the operator's Redis user
    reaches no other key and cannot delete the entry (the remediator does, fenced)."""
    remediator = _redis(secure_plane, "remediator")
    operator = _redis(secure_plane, "operator")
    try:
        await remediator.hset("tg:blocklist", "node-u", '{"reason": "sick"}')
        async with operator.pipeline(transaction=True) as pipe:
            await pipe.watch("tg:blocklist")
            assert await pipe.hget("tg:blocklist", "node-u") == b'{"reason": "sick"}'
            pipe.multi()  # type: ignore[no-untyped-call]
            pipe.hset("tg:blocklist", "node-u", '{"reason": "sick", "expires": 1.0}')
            await pipe.execute()
        for write in (lambda: operator.hdel("tg:blocklist", "node-u"),
                      lambda: operator.delete("tg:blocklist"),
                      lambda: operator.set("tg:epoch:remediator", "0"),
                      lambda: operator.get("tg:epoch:remediator")):
            with pytest.raises(NoPermissionError):
                await write()
        assert b"expires" in await remediator.hget("tg:blocklist", "node-u")
    finally:
        await remediator.hdel("tg:blocklist", "node-u")
        await remediator.aclose()
        await operator.aclose()


async def test_the_operator_may_set_a_job_s_mode_and_delete_nothing(
        secure_plane: EmbeddedControlPlane) -> None:
    """``trainguard observe`` / ``act`` write one job's mode; the remediator reads it."""
    remediator = _redis(secure_plane, "remediator")
    operator = _redis(secure_plane, "operator")
    try:
        await operator.hset("tg:mode", "job-m", '{"mode": "observe"}')
        assert await remediator.hget("tg:mode", "job-m") == b'{"mode": "observe"}'
        for write in (lambda: operator.hdel("tg:mode", "job-m"),
                      lambda: operator.delete("tg:mode")):
            with pytest.raises(NoPermissionError):
                await write()
    finally:
        await remediator.hdel("tg:mode", "job-m")
        await remediator.aclose()
        await operator.aclose()


async def test_credentials_stay_private(secure_plane: EmbeddedControlPlane) -> None:
    for path in (*secure_plane.credentials.values(), secure_plane.nats.auth_path,
                 secure_plane.redis.auth_path):
        assert Path(path).stat().st_mode & 0o077 == 0, path
    await asyncio.sleep(0)


async def test_jetstream_is_the_services_alone(connect: Any, job: str) -> None:
    """No stream that captures the endpoints, no deleted durable, but on-call still reads
    the event history (an ordered consumer and its flow control)."""
    from trainguard.contract.schemas import Anomaly
    from trainguard.runtime.bus import Bus
    from trainguard.runtime.topology import provision, stream_name, streams

    service = await connect("detector")
    await provision(service.nc.jetstream(), streams("tg"))
    agent = await connect("agent")
    with pytest.raises((nats.errors.TimeoutError, nats.js.errors.APIError)):
        await agent.nc.jetstream(timeout=1.0).add_stream(name="ROGUE",
                                                         subjects=["tg.*.rpc.>"])
    oncall = await connect("oncall")
    js = oncall.nc.jetstream(timeout=1.0)
    with pytest.raises((nats.errors.TimeoutError, nats.js.errors.APIError)):
        await js.delete_consumer(stream_name("tg", "events"), "remediator")
    now = 1.0
    await Bus(service.nc, S, source="test").publish_durable(S.event(job, "anomaly"), Anomaly(
        id="a1", job=job, kind="hang", ranks=[0], onset_at=now, detected_at=now))
    got: list[str] = []

    async def on_event(msg: Any) -> None:
        got.append(msg.subject)

    sub = await js.subscribe(S.pattern("event", job=job, tail=">"), cb=on_event,
                             ordered_consumer=True)
    await wait_until(lambda: got, what="on-call reading the event history")
    await sub.unsubscribe()
    assert got == [S.event(job, "anomaly")]


async def test_an_agent_publishes_its_preflight_record_and_no_other_event(
        connect: Any, job: str) -> None:
    """The node's pre-flight goes out from its agent (the remediator keeps a failed node
    out on it); an agent credential still cannot forge an incident or an action."""
    agent, reader = await connect("agent"), await connect("detector")
    got: list[str] = []

    async def on_event(msg: Any) -> None:
        got.append(msg.subject)

    await reader.nc.subscribe(f"{S.prefix}.{job}.event.>", cb=on_event)
    await flush(reader.nc)
    for kind in ("incident", "action"):
        await agent.nc.publish(S.event(job, kind), b"{}")

    async def preflight_heard() -> bool:
        # Sent until heard: nats-server 2.15 now and then does not deliver a core message
        # published just after a new subscription (about 1 in 20 here, auth or not).
        await agent.nc.publish(S.event(job, "preflight"), b"{}")
        await flush(agent.nc)
        return S.event(job, "preflight") in got

    await wait_until(preflight_heard, interval=0.2,
                     what=lambda: f"the preflight record (got {got}, the agent's errors "
                                  f"{agent.errors}, the reader's errors {reader.errors})")
    await wait_until(lambda: len(agent.errors) >= 2, what="two permission errors")
    assert set(got) == {S.event(job, "preflight")}
    assert all("permissions violation" in e.lower() for e in agent.errors), agent.errors
