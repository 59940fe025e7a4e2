"""TLS end to end with the shipped production configs (``deploy/``), on loopback.

A throwaway CA signs the certificates; three nats-servers run ``deploy/nats-cluster.conf``
(client and route TLS, the role permissions), a Redis primary and replica run
``deploy/redis-ha.conf`` (TLS only, TLS replication, ACL users) and a sentinel runs
``deploy/sentinel.conf``. The remediator service, reaching NATS through every node's
``tls://`` URL and Redis through a ``rediss+sentinel://`` URL, draws its fencing epoch; a
Guard with the rank role and only the CA (what ``trainguard launch`` hands its ranks)
publishes telemetry that a service-role subscriber receives. Plain connections are refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

import trainguard
from tests.conftest import wait_until
from tests.integration.recorder import running
from tests.tls import ConfiguredNats, ConfiguredRedis, make_pki, render
from trainguard.contract import envnames
from trainguard.contract.codec import decode_telemetry
from trainguard.contract.subjects import Subjects
from trainguard.core.auth import Role, ensure_credentials, nats_authorization, redis_acl_file
from trainguard.core.connection import flush
from trainguard.runtime.bus import BusUnavailable, connect_nats
from trainguard.runtime.config import load_settings
from trainguard.runtime.embedded import LOOPBACK, free_port
from trainguard.runtime.fencing import Epochs
from trainguard.runtime.redisha import MASTER_NAME, HaSecrets
from trainguard.runtime.state import Keys
from trainguard.runtime.store import StoreUnavailable, connect_redis
from trainguard.services.remediator.service import RemediatorService
from trainguard.services.remediator.settings import RemediatorSettings


@dataclass
class SecurePlane:
    pki: Path
    creds: dict[Role, Path]
    nats: list[ConfiguredNats]
    redis: list[ConfiguredRedis]

    @property
    def nats_url(self) -> str:
        return ",".join(n.url for n in self.nats)

    @property
    def redis_url(self) -> str:
        return f"rediss+sentinel://{LOOPBACK}:{self.redis[-1].port}/{MASTER_NAME}/0"

    def settings(self, role: Role, prefix: str, **extra: Any) -> dict[str, Any]:
        tls = {f"{kind}_tls_{part}": str(self.pki / name) for kind in ("nats", "redis")
               for part, name in (("ca", "ca.pem"), ("cert", "client.pem"),
                                  ("key", "client-key.pem"))}
        return {"nats_url": self.nats_url, "redis_url": self.redis_url, "prefix": prefix,
                "credentials": str(self.creds[role]), "stream_replicas": 3, **tls, **extra}


@pytest.fixture(scope="module")
def secure_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecurePlane]:
    root = tmp_path_factory.mktemp("tls")
    pki = make_pki(root / "etc" / "tls")
    creds = ensure_credentials(root / "creds")
    ha = HaSecrets.generate()
    started: list[Any] = []
    try:
        ports = [free_port() for _ in range(3)]
        routes = [free_port() for _ in range(3)]
        for i in range(3):
            etc, var = root / f"nats-{i}", root / f"nats-{i}" / "var"
            (etc / "tls").mkdir(parents=True)
            for f in ("ca.pem", "nats-server.pem", "nats-server-key.pem"):
                (etc / "tls" / f).write_bytes((pki / f).read_bytes())
            (etc / "nats-auth.conf").write_text(nats_authorization(creds))
            peers = ", ".join(f'"tls://{LOOPBACK}:{r}"' for j, r in enumerate(routes) if j != i)
            (etc / "nats-node.conf").write_text(
                f"NODE_NAME: n{i}\nCLIENT_LISTEN: \"{LOOPBACK}:{ports[i]}\"\n"
                f"ROUTE_LISTEN: \"{LOOPBACK}:{routes[i]}\"\n"
                f"MONITOR_LISTEN: \"{LOOPBACK}:{free_port()}\"\nROUTES: [{peers}]\n")
            node = ConfiguredNats(ports[i], etc, render("nats-cluster.conf", etc, var))
            node.start()
            started.append(node)
        etc = root / "redis-etc"
        (etc / "tls").mkdir(parents=True)
        for f in ("ca.pem", "redis.pem", "redis-key.pem"):
            (etc / "tls" / f).write_bytes((pki / f).read_bytes())
        (etc / "redis-users.acl").write_text(redis_acl_file(creds) + ha.acl_lines())
        (etc / "redis-replication.conf").write_text(ha.data_node_conf())
        (etc / "sentinel-auth.conf").write_text(ha.sentinel_conf())
        for name in ("redis-a", "redis-b", "sentinel", "var/redis", "var/sentinel"):
            (root / name).mkdir(parents=True)
        primary_port = free_port()
        primary = ConfiguredRedis(primary_port, root / "redis-a", render(
            "redis-ha.conf", etc, root / "var"), pki,
            ["--dir", str(root / "redis-a")])
        replica = ConfiguredRedis(free_port(), root / "redis-b", etc / "redis-ha.conf", pki,
                                  ["--dir", str(root / "redis-b"),
                                   "--replicaof", LOOPBACK, str(primary_port)])
        sentinel = ConfiguredRedis(free_port(), root / "sentinel", render(
            "sentinel.conf", etc, root / "var", {"redis-1.trainguard.internal 6379":
                                         f"{LOOPBACK} {primary_port}"}), pki,
            ["--dir", str(root / "sentinel")], sentinel=True)
        for server in (primary, replica, sentinel):
            server.start()
            started.append(server)
        plane = SecurePlane(pki, {r: root / "creds" / f"{r}.json" for r in creds},
                            started[:3], [primary, replica, sentinel])
        yield plane
    finally:
        for server in reversed(started):
            with contextlib.suppress(Exception):
                server.stop()


@pytest.fixture
async def service_redis(secure_plane: SecurePlane) -> AsyncIterator[aioredis.Redis]:
    s = load_settings(RemediatorSettings, env={},
                      overrides=secure_plane.settings("detector", "tg"))
    client = await connect_redis(s.redis_url, access=s.access.redis_options())
    try:
        yield client
    finally:
        await client.aclose()


async def test_plain_connections_are_refused(secure_plane: SecurePlane) -> None:
    plain_nats = secure_plane.nats_url.replace("tls://", "nats://")
    with pytest.raises(BusUnavailable):
        await connect_nats(plain_nats, name="plain", timeout=3.0)
    with pytest.raises(StoreUnavailable):
        await connect_redis(f"redis://{LOOPBACK}:{secure_plane.redis[0].port}/0", timeout=3.0)


async def test_the_replica_replicates_over_tls(service_redis: aioredis.Redis,
                                               secure_plane: SecurePlane) -> None:
    await service_redis.set("tg:tls-probe", "replicated")
    s = load_settings(RemediatorSettings, env={},
                      overrides=secure_plane.settings("detector", "tg"))
    replica_url = f"rediss://{LOOPBACK}:{secure_plane.redis[1].port}/0"
    replica = await connect_redis(replica_url, access=s.access.redis_options())
    try:
        await wait_until(lambda: _get(replica, "tg:tls-probe"), timeout=30,
                         what="the write on the replica")
    finally:
        await replica.aclose()


async def _get(client: aioredis.Redis, key: str) -> bool:
    return bool(await client.get(key) == "replicated")


async def test_a_service_and_a_guard_work_over_tls(secure_plane: SecurePlane, job: str,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   service_redis: aioredis.Redis) -> None:
    prefix = "tg"  # the prefix the role permissions were rendered for
    settings = load_settings(RemediatorSettings, env={}, overrides=secure_plane.settings(
        "remediator", prefix, lease_ttl=1.0))
    service = RemediatorService(settings)
    async with running(service) as rt:
        await wait_until(lambda: service.leader is not None and service.leader.leading,
                         timeout=30, what="the remediator leading over TLS")
        assert service.leader is not None
        epoch = service.leader.epoch
        assert await Epochs(rt.bus.js, prefix).current("remediator") == epoch
        assert int(await service_redis.get(Keys(prefix).epoch("remediator"))) == epoch
        assert (await rt.ready())[0]

        # A rank: its role's credentials and the CA, nothing else (as the agent hands them).
        listener = load_settings(RemediatorSettings, env={},
                                 overrides=secure_plane.settings("detector", prefix))
        nc = await connect_nats(listener.nats_url, name="listener",
                                access=listener.access.nats_options())
        beats: list[Any] = []

        async def on_beat(msg: Any) -> None:
            beats.append(decode_telemetry(msg.data))

        try:
            await nc.subscribe(Subjects(prefix).pattern("hb", tail=">"), cb=on_beat)
            await flush(nc)
            monkeypatch.setenv(envnames.CREDENTIALS, str(secure_plane.creds["rank"]))
            monkeypatch.setenv(envnames.NATS_TLS_CA, str(secure_plane.pki / "ca.pem"))
            guard = trainguard.Guard(job=job, rank=0, world_size=1, host="node-a",
                                     nats_url=secure_plane.nats_url, prefix=prefix,
                                     heartbeat_interval=0.2).start()
            try:
                await wait_until(lambda: guard.connected, timeout=30,
                                 what="the Guard connected over TLS")
                await wait_until(lambda: beats, timeout=30, what="a heartbeat over TLS")
            finally:
                guard.close()
        finally:
            await nc.close()
