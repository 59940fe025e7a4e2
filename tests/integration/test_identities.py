"""Scoped identities against a real nats-server in operator mode (JWT auth, memory resolver).

Each credential is minted here the way the control plane mints it; the server, not
trainguard, refuses what an identity may not do.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client as NATS
from nats.js import api as js_api

from tests.conftest import wait_until
from trainguard import Guard
from trainguard.agent.link import AgentLink
from trainguard.agent.node import LocalNode
from trainguard.agent.rankcreds import CredentialsRefused, RankCredentials
from trainguard.agent.settings import AgentSettings
from trainguard.cli import main as cli_main
from trainguard.cli.credentials import run as cli_run
from trainguard.contract.errors import ConfigError
from trainguard.contract.rpc import (
    CONSUMER,
    CREDS,
    CommandConsumerReply,
    CommandConsumerRequest,
    RankCredentialsRequest,
)
from trainguard.contract.schemas import NodeHello
from trainguard.contract.subjects import Subjects, stream_name
from trainguard.core.auth import access_from, write_private
from trainguard.core.connection import flush
from trainguard.core.identities import (
    Minter,
    Trust,
    agent_durable,
    ensure_system_creds,
    expiry_of,
    issuer_permissions,
    revoke,
)
from trainguard.core.natsjwt import Key, Permissions, claims_of, jwt_of_creds
from trainguard.runtime.config import load_settings
from trainguard.runtime.embedded import EmbeddedControlPlane, NatsServer, free_port
from trainguard.runtime.issuer import serve_issuer
from trainguard.runtime.topology import agent_consumer, ensure_consumer, provision, streams

PREFIX = "tg"
S = Subjects(PREFIX)


@pytest.fixture
def trust(tmp_path: Path) -> Trust:
    return Trust.ensure(tmp_path / "trust")


@pytest.fixture
def operator_nats(tmp_path: Path, trust: Trust) -> Iterator[NatsServer]:
    server = NatsServer(free_port(), tmp_path / "nats",
                        auth=trust.server_config(tmp_path / "nats" / "jwt"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


class Client:
    """A connection under one credential, keeping the server's errors it was sent."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc: Any = None

    async def error_cb(self, exc: Exception) -> None:
        self.errors.append(str(exc).lower())

    def refused(self, subject: str) -> bool:
        return any("permissions violation" in e and subject.lower() in e for e in self.errors)


@contextlib.asynccontextmanager
async def connected(server: NatsServer, creds_text: str,
                    tmp_path: Path) -> AsyncIterator[Client]:
    path = tmp_path / f"{free_port()}.creds"
    path.write_text(creds_text)
    client = Client()
    client.nc = NATS()
    try:  # closed even when the connect is refused (else its socket leaks)
        await client.nc.connect(server.url, error_cb=client.error_cb, allow_reconnect=False,
                                connect_timeout=5, **access_from(str(path)).nats_options())
        yield client
    finally:
        await client.nc.close()


async def received(nc: Any, subject: str) -> list[str]:
    seen: list[str] = []

    async def cb(msg: Any) -> None:
        seen.append(msg.subject)

    await nc.subscribe(subject, cb=cb)
    await flush(nc)
    return seen


class Stepper:
    """Each call runs the guard's next step (its report goes out as a trainer's would)."""

    def __init__(self, guard: Guard) -> None:
        self.guard, self.taken = guard, 0

    def __call__(self) -> None:
        with self.guard.step(self.taken):
            pass
        self.taken += 1


async def test_a_rank_publishes_its_own_subjects_only(
        operator_nats: NatsServer, trust: Trust, tmp_path: Path) -> None:
    minter = trust.minter
    async with connected(operator_nats, minter.mint_role("detector", PREFIX), tmp_path) as svc, \
            connected(operator_nats, minter.mint_rank(PREFIX, "j", 1, 600), tmp_path) as rank:
        seen = await received(svc.nc, "tg.>")
        for subject in (S.step("j", 2), S.hb("k", 1), S.snap("j", 2), S.step("j", 1),
                        S.snap("j", 1)):
            await rank.nc.publish(subject, b"x")
        await flush(rank.nc)
        await wait_until(lambda: len(seen) == 2, what="the rank's own step and snapshot reports")
        await wait_until(lambda: rank.refused(S.step("j", 2)) and rank.refused(S.hb("k", 1))
                         and rank.refused(S.snap("j", 2)),
                         what="the server to refuse the foreign subjects")
        await flush(svc.nc)
        assert seen == [S.step("j", 1), S.snap("j", 1)]


async def test_a_rank_cannot_hear_another_ranks_commands_or_pull_an_agents_consumer(
        operator_nats: NatsServer, trust: Trust, tmp_path: Path) -> None:
    minter = trust.minter
    async with connected(operator_nats, minter.mint_rank(PREFIX, "j", 1, 600), tmp_path) as rank:
        await rank.nc.subscribe(S.cmd_rank("j", 2))
        await rank.nc.subscribe(S.cmd_rank("j", 1))
        durable = agent_durable("j", "h1")
        pull = f"$JS.API.CONSUMER.MSG.NEXT.{stream_name(PREFIX, 'cmds')}.{durable}"
        await rank.nc.publish(pull, b"{}")
        await flush(rank.nc)
        await wait_until(lambda: rank.refused(S.cmd_rank("j", 2)) and rank.refused(pull),
                         what="both refusals")
        assert not rank.refused(S.cmd_rank("j", 1))


async def ask_for_consumer(agent: Client, host: str, said: str | None = None,
                           timeout: float = 5) -> CommandConsumerReply:
    msg = await agent.nc.request(S.rpc_consumer("j", host), CONSUMER.encode_request(
        CommandConsumerRequest(host=said or host)), timeout=timeout)
    return CONSUMER.decode_reply(msg.data)


async def test_an_agent_pulls_its_own_command_consumer_and_not_another_hosts(
        operator_nats: NatsServer, trust: Trust, tmp_path: Path) -> None:
    minter = trust.minter
    specs = {h: agent_consumer(PREFIX, "j", h) for h in ("h1", "h2")}
    async with connected(operator_nats, minter.mint_role("remediator", PREFIX),
                         tmp_path) as svc, \
            connected(operator_nats, minter.mint("issuer", issuer_permissions(PREFIX)),
                      tmp_path) as issuer, \
            connected(operator_nats, minter.mint_agent(PREFIX, "j", "h1"), tmp_path) as agent:
        await provision(svc.nc.jetstream(), streams(PREFIX))
        await serve_issuer(issuer.nc, minter, PREFIX, ttl=600)
        await ensure_consumer(svc.nc.jetstream(), PREFIX, specs["h2"])
        js = agent.nc.jetstream()
        made = await ask_for_consumer(agent, "h1")  # the control plane makes it
        assert made.ok and made.durable == specs["h1"].durable
        stream = made.stream
        own = await js.pull_subscribe_bind(specs["h1"].durable, stream)
        for h in ("h2", "h1"):
            await svc.nc.jetstream().publish(S.cmd_host("j", h), f"for {h}".encode())
        [msg] = await own.fetch(1, timeout=10)
        assert msg.data == b"for h1"
        await msg.ack()
        other = await js.pull_subscribe_bind(specs["h2"].durable, stream)
        with pytest.raises((nats.errors.Error, asyncio.TimeoutError)):
            await other.fetch(1, timeout=2)
        await wait_until(lambda: agent.refused(specs["h2"].durable),
                         what="the server to refuse another host's durable")
        with pytest.raises((nats.errors.Error, asyncio.TimeoutError)):
            await ensure_consumer(js, PREFIX, specs["h2"])
        # The command for h2 is still h2's to take.
        info = await svc.nc.jetstream().consumer_info(stream, specs["h2"].durable)
        assert info.num_pending == 1


async def test_an_agent_cannot_create_its_command_consumer_with_another_hosts_filter(
        operator_nats: NatsServer, trust: Trust, tmp_path: Path) -> None:
    """An agent's own durable, created with a filter naming another host's commands, is
    refused in every form of JetStream's create request; the control plane makes it with
    its own host's filters at its ask (and only at its own host's agent's ask)."""
    minter = trust.minter
    durable = agent_durable("j", "h1")
    stream = stream_name(PREFIX, "cmds")
    foreign = [S.cmd_all("j"), S.cmd_host("j", "h2")]
    async with connected(operator_nats, minter.mint_role("remediator", PREFIX),
                         tmp_path) as svc, \
            connected(operator_nats, minter.mint("issuer", issuer_permissions(PREFIX)),
                      tmp_path) as issuer, \
            connected(operator_nats, minter.mint_agent(PREFIX, "j", "h1"), tmp_path) as agent:
        await provision(svc.nc.jetstream(), streams(PREFIX))
        js = agent.nc.jetstream(timeout=2)
        with pytest.raises((nats.errors.Error, asyncio.TimeoutError)):  # legacy form
            await js.add_consumer(stream, js_api.ConsumerConfig(
                durable_name=durable, ack_policy=js_api.AckPolicy.EXPLICIT,
                filter_subjects=foreign))
        api = f"$JS.API.CONSUMER.CREATE.{stream}.{durable}"
        for subject, config in ((api, {"filter_subjects": foreign}),
                                (f"{api}.{foreign[1]}", {"filter_subject": foreign[1]})):
            body = json.dumps({"stream_name": stream, "config": {
                "durable_name": durable, "ack_policy": "explicit", **config}}).encode()
            with pytest.raises((nats.errors.Error, asyncio.TimeoutError)):
                await agent.nc.request(subject, body, timeout=2)
        await wait_until(lambda: all(agent.refused(x) for x in (
            f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{durable}", api,
            f"{api}.{foreign[1]}")), what="the server to refuse all three creates")
        with pytest.raises(nats.js.errors.NotFoundError):
            await svc.nc.jetstream().consumer_info(stream, durable)
        await serve_issuer(issuer.nc, minter, PREFIX, ttl=600)
        with pytest.raises((nats.errors.Error, asyncio.TimeoutError)):  # h2's subject
            await ask_for_consumer(agent, "h2", timeout=2)
        await wait_until(lambda: agent.refused(S.rpc_consumer("j", "h2")),
                         what="the server to refuse h1's agent on h2's subject")
        lying = await ask_for_consumer(agent, "h1", said="h2")
        assert not lying.ok and "names host 'h2'" in lying.reason
        made = await ask_for_consumer(agent, "h1")
        assert made.ok and (made.stream, made.durable) == (stream, durable)
        info = await svc.nc.jetstream().consumer_info(stream, durable)
        assert sorted(info.config.filter_subjects or []) == sorted(
            [S.cmd_all("j"), S.cmd_host("j", "h1")])
        sub = await agent.nc.jetstream().pull_subscribe_bind(durable, stream)
        for h in ("h2", "h1"):
            await svc.nc.jetstream().publish(S.cmd_host("j", h), f"for {h}".encode())
        [msg] = await sub.fetch(1, timeout=10)
        assert msg.data == b"for h1"


async def test_an_expired_credential_is_refused(operator_nats: NatsServer, trust: Trust,
                                                tmp_path: Path) -> None:
    minter: Minter = trust.minter
    text = minter.mint_rank(PREFIX, "j", 1, ttl=-5)
    exp = expiry_of(text)
    assert exp is not None and claims_of(jwt_of_creds(text))["exp"] == int(exp)
    with pytest.raises(nats.errors.Error, match=r"(?i)authorization|expired"):
        async with connected(operator_nats, text, tmp_path):
            pass
    # A live one of the same rank connects: the refusal was the expiry's.
    async with connected(operator_nats, minter.mint_rank(PREFIX, "j", 1, 600), tmp_path):
        pass


async def test_credentials_cli_mints_a_deployment_the_server_enforces(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``trainguard credentials --jwt``: the server's config and each identity's file."""
    out = tmp_path / "creds"
    assert cli_main(["credentials", "--jwt", "--out", str(out), "--agent", "j:node-a",
                     "--rank", "j:0", "--ttl", "600"]) == 0
    assert "rank 0 of j" in capsys.readouterr().out
    server = NatsServer(free_port(), tmp_path / "nats",
                        auth=(out / "nats-operator.conf").read_text())
    server.start()
    try:
        async with connected(server, (out / "detector.creds").read_text(), tmp_path) as svc, \
                connected(server, (out / "rank-j-0.creds").read_text(), tmp_path) as rank:
            seen = await received(svc.nc, "tg.>")
            await rank.nc.publish(S.hb("j", 1), b"x")
            await rank.nc.publish(S.hb("j", 0), b"x")
            await flush(rank.nc)
            await wait_until(lambda: seen and rank.refused(S.hb("j", 1)),
                             what="rank 0's beat through, rank 1's refused")
            assert seen == [S.hb("j", 0)]
        assert expiry_of((out / "agent-j-node-a.creds").read_text()) is None
    finally:
        server.stop()
    with pytest.raises(ConfigError, match="JOB:HOST"):
        cli_run(argparse.Namespace(job="*", template=False, out=str(out), jwt=True,
                                   agent=["node-a"], rank=[], ttl=600.0, agent_ttl=None,
                                   prefix=PREFIX))


async def test_an_operator_revokes_one_identity_with_the_credentials_cli(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``trainguard credentials --jwt --revoke FILE``: the running server ends that
    identity's connection and refuses it again, also once restarted with the config the
    command rewrote; another rank's credential is untouched."""
    out = tmp_path / "creds"
    assert cli_main(["credentials", "--jwt", "--out", str(out), "--rank", "j:0",
                     "--rank", "j:1"]) == 0
    server = NatsServer(free_port(), tmp_path / "nats",
                        auth=(out / "nats-operator.conf").read_text())
    server.start()
    revoked, kept = (out / "rank-j-0.creds").read_text(), (out / "rank-j-1.creds").read_text()
    try:
        async with connected(server, revoked, tmp_path) as r0, \
                connected(server, kept, tmp_path) as r1:
            assert await asyncio.to_thread(  # it runs its own event loop
                cli_main, ["credentials", "--jwt", "--out", str(out), "--revoke",
                           str(out / "rank-j-0.creds"), "--nats", server.url]) == 0
            key = claims_of(jwt_of_creds(revoked))["sub"]
            assert f"revoked {key}" in capsys.readouterr().out
            await wait_until(lambda: r0.nc.is_closed, what="the revoked rank's connection ended")
            await r1.nc.publish(S.hb("j", 1), b"x")
            await r1.nc.flush(timeout=5)
            assert r1.nc.is_connected
        for restarted in (False, True):
            if restarted:  # on the config the command rewrote
                server.stop()
                server.auth = (out / "nats-operator.conf").read_text()
                server.start()
            with pytest.raises(nats.errors.Error, match=r"(?i)authorization|revoked"):
                async with connected(server, revoked, tmp_path):
                    pass
            async with connected(server, kept, tmp_path):
                pass
    finally:
        server.stop()
    assert cli_main(["credentials", "--jwt", "--out", str(out), "--revoke", "rank-9"]) == 2
    assert "give a user public key (U...) or a .creds file" in capsys.readouterr().err


async def test_a_rank_renewed_before_expiry_loses_no_telemetry(
        operator_nats: NatsServer, trust: Trust, tmp_path: Path) -> None:
    """A rank's credential is rewritten before it expires (as its renewal does): the
    Guard switches to a connection made with the new one before the old expires, every
    step report arrives once, and it keeps publishing past the first credential's
    expiry. (nats-py does not reconnect after the server ends an expired connection.)"""
    minter = trust.minter
    path = tmp_path / "rank-0.creds"
    write_private(path, minter.mint_rank(PREFIX, "j", 0, ttl=4))
    expires = expiry_of(path.read_text())
    assert expires is not None
    async with connected(operator_nats, minter.mint_role("detector", PREFIX), tmp_path) as svc:
        seen = await received(svc.nc, S.step("j", 0))
        guard = Guard(job="j", rank=0, world_size=1, host="h", nats_url=operator_nats.url,
                      prefix=PREFIX, heartbeat_interval=0.2, credentials=str(path))
        try:
            take_step = Stepper(guard)

            await wait_until(lambda: take_step() or seen, what="the first step report")
            write_private(path, minter.mint_rank(PREFIX, "j", 0, ttl=600))  # the renewal
            await wait_until(lambda: guard.transport.stats.renewals == 1,
                             what="the switch to the renewed credential")
            while time.time() < expires + 1.5:  # past the first credential's expiry
                take_step()
                await asyncio.sleep(0.02)
            await wait_until(lambda: len(seen) == take_step.taken, timeout=15,
                             what=f"all {take_step.taken} step reports")
        finally:
            guard.close()
    assert "ended_by_server" not in guard.transport.stats.errors
    assert guard.transport.stats.dropped == 0


async def test_a_rank_whose_credential_expired_connects_again_with_the_renewed_one(
        operator_nats: NatsServer, trust: Trust, tmp_path: Path) -> None:
    """Renewed too late: the server ends the expired connection; the Guard connects
    anew (nats-py would not) with the file as it is then, and reports resume."""
    minter = trust.minter
    path = tmp_path / "rank-0.creds"
    write_private(path, minter.mint_rank(PREFIX, "j", 0, ttl=2))
    async with connected(operator_nats, minter.mint_role("detector", PREFIX), tmp_path) as svc:
        seen = await received(svc.nc, S.step("j", 0))
        guard = Guard(job="j", rank=0, world_size=1, host="h", nats_url=operator_nats.url,
                      prefix=PREFIX, heartbeat_interval=0.2, credentials=str(path))
        try:
            with guard.step(0):
                pass
            await wait_until(lambda: seen, what="the first step report")
            await wait_until(lambda: guard.transport.stats.errors.get("ended_by_server"),
                             what="the server to end the expired connection")
            write_private(path, minter.mint_rank(PREFIX, "j", 0, ttl=600))
            with guard.step(1):
                pass
            await wait_until(lambda: len(seen) == 2, what="the report after the renewal")
        finally:
            guard.close()


async def test_an_agent_obtains_and_renews_its_ranks_credentials_from_the_issuer(
        operator_nats: NatsServer, trust: Trust, tmp_path: Path) -> None:
    """The issuer mints, for the public keys an agent made, credentials for its own job's
    ranks; each file works for its rank only; a renewal rewrites them later-expiring; an
    agent of another job cannot ask for this job's ranks (the server refuses the ask)."""
    minter = trust.minter
    issuer_creds = minter.mint("issuer", issuer_permissions(PREFIX))
    async with connected(operator_nats, issuer_creds, tmp_path) as issuer, \
            connected(operator_nats, minter.mint_agent(PREFIX, "j", "h1"), tmp_path) as agent, \
            connected(operator_nats, minter.mint_agent(PREFIX, "k", "h9"), tmp_path) as other:
        await serve_issuer(issuer.nc, minter, PREFIX, ttl=600)
        ranks = RankCredentials(tmp_path / "ranks", S, "j", "h1")
        first = await ranks.obtain(agent.nc, {0: 0, 1: 1})
        assert ranks.pattern.format(local_rank=1) == str(ranks.path(1))
        assert (ranks.path(0).stat().st_mode & 0o777) == 0o600
        async with connected(operator_nats, minter.mint_role("detector", PREFIX),
                             tmp_path) as svc, \
                connected(operator_nats, ranks.path(1).read_text(), tmp_path) as rank:
            seen = await received(svc.nc, "tg.>")
            await rank.nc.publish(S.step("j", 0), b"x")
            await rank.nc.publish(S.step("j", 1), b"x")
            await flush(rank.nc)
            await wait_until(lambda: seen and rank.refused(S.step("j", 0)), timeout=30,
                             what="rank 1's own report through, rank 0's refused")
            assert seen == [S.step("j", 1)]
        before = ranks.path(0).read_text()
        assert (await ranks.renew(agent.nc) or 0) >= first  # the renewal
        assert ranks.path(0).read_text() != before and ranks.renew_in() > 0
        with pytest.raises(CredentialsRefused):  # job k's agent, on job j's subject
            await RankCredentials(tmp_path / "k", S, "j", "h9", timeout=2).obtain(
                other.nc, {0: 0})
        await wait_until(lambda: other.refused(S.rpc_creds("j", "h9")),
                         what="the server to refuse job k's agent")
        bad = await agent.nc.request(S.rpc_creds("j", "h1"),
                                     b'{"host": "h1", "keys": {"0": "not-a-key"}}', timeout=5)
        reply = CREDS.decode_reply(bad.data)
        assert not reply.ok and "not a user public key" in reply.reason


async def test_an_agent_obtains_rank_credentials_for_its_own_host_only(
        operator_nats: NatsServer, trust: Trust, tmp_path: Path) -> None:
    """The issuer knows which host asks: the agent of h1 cannot ask in h2's name (the
    server refuses its ask on h2's subject, the issuer a body naming h2 on h1's), and
    every rank credential it obtains names h1."""
    minter = trust.minter
    issuer_creds = minter.mint("issuer", issuer_permissions(PREFIX))
    async with connected(operator_nats, issuer_creds, tmp_path) as issuer, \
            connected(operator_nats, minter.mint_agent(PREFIX, "j", "h1"), tmp_path) as agent:
        await serve_issuer(issuer.nc, minter, PREFIX, ttl=600)
        with pytest.raises(CredentialsRefused):  # h1's agent, asking as h2
            await RankCredentials(tmp_path / "h2", S, "j", "h2", timeout=2).obtain(
                agent.nc, {0: 4})
        await wait_until(lambda: agent.refused(S.rpc_creds("j", "h2")),
                         what="the server to refuse h1's agent on h2's subject")
        assert not (tmp_path / "h2" / "local-0.creds").exists()
        lying = await agent.nc.request(
            S.rpc_creds("j", "h1"),
            CREDS.encode_request(RankCredentialsRequest(
                host="h2", keys={4: Key.new("user").public})), timeout=5)
        reply = CREDS.decode_reply(lying.data)
        assert not reply.ok and "names host 'h2'" in reply.reason
        own = RankCredentials(tmp_path / "h1", S, "j", "h1")
        await own.obtain(agent.nc, {0: 0, 1: 1})
        names = {claims_of(jwt_of_creds(own.path(r).read_text()))["name"] for r in (0, 1)}
        assert names == {"rank-j-0@h1", "rank-j-1@h1"}


@contextlib.asynccontextmanager
async def issuing(server: NatsServer, trust: Trust, tmp_path: Path) -> AsyncIterator[None]:
    """The issuer as ``trainguard up`` runs it: revoking what it replaces, as the system
    account."""
    minter = trust.minter
    system = ensure_system_creds(tmp_path, trust).read_text()
    async with connected(server, minter.mint("issuer", issuer_permissions(PREFIX)),
                         tmp_path) as issuer, connected(server, system, tmp_path) as sys_nc:
        await serve_issuer(issuer.nc, minter, PREFIX, ttl=600,
                           revoke=functools.partial(revoke, sys_nc.nc, trust))
        yield


async def test_a_rank_renumbered_in_place_reports_on_its_new_numbers_credential(
        operator_nats: NatsServer, trust: Trust, tmp_path: Path) -> None:
    """Processes renumbered in place (ranks 2 and 3 of host h1 become 0 and 1 when the
    host of 0 and 1 leaves) keep their credential files: their agent writes the new
    numbers' credentials over them, the Guard moves to it, its reports under the new number
    go through, and the agent renews the new numbers only. The old numbers' credentials are
    revoked as the new ones are issued: their connections are ended, they connect no more."""
    minter = trust.minter
    async with issuing(operator_nats, trust, tmp_path), \
            connected(operator_nats, minter.mint_agent(PREFIX, "j", "h1"), tmp_path) as agent, \
            connected(operator_nats, minter.mint_role("detector", PREFIX), tmp_path) as svc:
        seen = await received(svc.nc, "tg.j.step.*")
        rc = RankCredentials(tmp_path / "ranks", S, "j", "h1")
        await rc.obtain(agent.nc, {0: 2, 1: 3})
        old = rc.path(0).read_text()  # rank 2's, as a process that read it keeps it
        guard = Guard(job="j", rank=3, world_size=4, host="h1", nats_url=operator_nats.url,
                      prefix=PREFIX, heartbeat_interval=0.2, credentials=str(rc.path(1)))
        try:
            take_step = Stepper(guard)

            await wait_until(lambda: take_step() or S.step("j", 3) in seen,
                             what="rank 3's step report")
            async with connected(operator_nats, old, tmp_path) as holder:
                guard.resize(2, rank=1)  # the host of ranks 0 and 1 left
                assert await rc.renumber(agent.nc, {2: 0, 3: 1}) is not None
                assert rc.held == {0: 0, 1: 1}
                await wait_until(lambda: holder.nc.is_closed,
                                 what="the old number's live connection ended")
            with pytest.raises(nats.errors.Error, match=r"(?i)authorization|revoked"):
                async with connected(operator_nats, old, tmp_path):
                    pass
            await wait_until(lambda: take_step() or S.step("j", 1) in seen, timeout=15,
                             what="the renumbered rank's report as rank 1")
            name = claims_of(jwt_of_creds(rc.path(1).read_text()))["name"]
            assert name == "rank-j-1@h1" and rc.ranks == {0, 1}
            assert await rc.renew(agent.nc) is not None  # renews the new numbers only
            assert claims_of(jwt_of_creds(rc.path(1).read_text()))["name"] == "rank-j-1@h1"
            async with connected(operator_nats, rc.path(0).read_text(), tmp_path):
                pass  # a renewal revokes nothing: the new number's connects
        finally:
            guard.close()


async def test_the_issuer_revokes_no_credential_of_another_host(
        operator_nats: NatsServer, trust: Trust, tmp_path: Path) -> None:
    """An agent cannot have another host's ranks' credentials revoked by naming them as
    replaced: the issuer refuses the request whole, and the credential still connects."""
    minter = trust.minter
    async with issuing(operator_nats, trust, tmp_path), \
            connected(operator_nats, minter.mint_agent(PREFIX, "j", "h1"), tmp_path) as h1, \
            connected(operator_nats, minter.mint_agent(PREFIX, "j", "h2"), tmp_path) as h2:
        theirs = RankCredentials(tmp_path / "h2", S, "j", "h2")
        await theirs.obtain(h2.nc, {0: 5})
        token = jwt_of_creds(theirs.path(0).read_text())
        req = RankCredentialsRequest(host="h1", keys={1: Key.new("user").public},
                                     replaces=[token])
        msg = await h1.nc.request(S.rpc_creds("j", "h1"), CREDS.encode_request(req), timeout=5)
        reply = CREDS.decode_reply(msg.data)
        assert not reply.ok and "rank-j-5@h2" in reply.reason
        async with connected(operator_nats, theirs.path(0).read_text(), tmp_path):
            pass


async def test_an_agent_in_jwt_mode_hands_each_rank_its_own_credential(
        tmp_path: Path) -> None:
    """The agent's link on its host's credential (the embedded servers of ``trainguard up
    --auth jwt``, with the issuer): it binds its own command consumer, says hello, and
    obtains rank 3's credential before that rank would start; the rank's Guard reports
    on it."""
    plane = EmbeddedControlPlane(tmp_path / "plane", secure=True, prefix=PREFIX,
                                 auth_mode="jwt")
    plane.start()
    try:
        assert plane.trust is not None
        minter = plane.trust.minter
        issuer_creds = minter.mint("issuer", issuer_permissions(PREFIX))
        agent_file = tmp_path / "agent-j-node-a.creds"
        write_private(agent_file, minter.mint_agent(PREFIX, "j", "node-a"))
        async with connected(plane.nats, issuer_creds, tmp_path) as issuer, \
                connected(plane.nats, minter.mint("test", Permissions((">",), (">",))),
                          tmp_path) as observer:
            await serve_issuer(issuer.nc, minter, PREFIX, ttl=600)
            await provision(observer.nc.jetstream(), streams(PREFIX))  # as the services do
            seen = await received(observer.nc, "tg.j.>")
            rc = RankCredentials(tmp_path / "ranks", S, "j", "node-a")
            settings = load_settings(AgentSettings, env={}, overrides={
                "nats_url": plane.nats.url, "redis_url": plane.redis.url, "prefix": PREFIX,
                "job": "j", "host": "node-a", "node_interval": 0.2, "gpu_interval": 60.0,
                "credentials": str(plane.credentials["agent"]),
                "nats_creds": str(agent_file), "rank_credentials": rc.pattern})
            node = LocalNode(settings, hosts_store=False, gpu=None,
                             publish_exit=lambda _: None)
            link = AgentLink(settings, node, NodeHello(job="j", host="node-a"))
            link.rank_credentials = rc
            link.start()
            try:
                assert await asyncio.to_thread(link.ready.wait, 30), "agent link not ready"
                await asyncio.to_thread(link.ensure_rank_credentials, 1, 3)
                assert rc.held == {1: 3}
                guard = Guard(job="j", rank=3, world_size=4, host="node-a",
                              nats_url=plane.nats.url, prefix=PREFIX,
                              credentials=str(rc.path(1)))
                try:
                    with guard.step(0):
                        pass
                    await wait_until(lambda: S.step("j", 3) in seen, timeout=30,
                                     what="rank 3's step report on its own credential")
                finally:
                    guard.close()
                assert S.reg_node("j", "node-a") in seen and S.node("j", "node-a") in seen
            finally:
                link.close()
    finally:
        plane.stop()
