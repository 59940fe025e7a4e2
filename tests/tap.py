"""A subscriber that records what one job's ranks and agents publish, decoded."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import nats

from trainguard.contract.codec import decode_any_durable, decode_telemetry
from trainguard.contract.envelope import H_ID, H_TYPE, normalize_headers
from trainguard.contract.schemas import CommandAck, Durable, NodeHello, RankHello, WorkerExit
from trainguard.contract.subjects import Subjects
from trainguard.core.connection import flush
from trainguard.runtime.bus import Bus
from trainguard.runtime.topology import provision, streams


class Tap:
    def __init__(self) -> None:
        self.telemetry: list[Any] = []
        self.durable: list[Durable] = []
        self._ids: set[str] = set()
        """Message ids seen: a publisher's retry reaches core subscribers again, though
        the stream keeps one copy."""

    def of(self, cls: type) -> list[Any]:
        return [m for m in (*self.telemetry, *self.durable) if isinstance(m, cls)]

    @property
    def acks(self) -> list[CommandAck]:
        return self.of(CommandAck)

    @property
    def hellos(self) -> list[RankHello]:
        return self.of(RankHello)

    @property
    def node_hellos(self) -> list[NodeHello]:
        return self.of(NodeHello)

    @property
    def exits(self) -> list[WorkerExit]:
        return self.of(WorkerExit)


@contextlib.asynccontextmanager
async def tapped(url: str, prefix: str, job: str,
                 replicas: int = 1) -> AsyncIterator[tuple[Tap, Bus]]:
    """Provision the topology, subscribe to everything of ``job``; yield the tap and a bus."""
    nc = await nats.connect(url.split(","), max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    s = Subjects(prefix)
    await provision(nc.jetstream(timeout=10.0), streams(prefix, replicas=replicas))
    tap = Tap()

    async def on_tel(msg: Any) -> None:
        tap.telemetry.append(decode_telemetry(msg.data))

    async def on_durable(msg: Any) -> None:
        headers = normalize_headers(msg.headers)
        ident = headers.get(H_ID, "")
        if ident and ident in tap._ids:
            return
        tap._ids.add(ident)
        tap.durable.append(decode_any_durable(msg.data, headers.get(H_TYPE)))

    for kind in ("hb", "step", "fp", "node", "gpu"):
        await nc.subscribe(s.pattern(kind, job=job), cb=on_tel)
    for kind in ("ack", "reg", "exit", "recovery"):
        await nc.subscribe(s.pattern(kind, job=job), cb=on_durable)
    await flush(nc)
    try:
        yield tap, Bus(nc, s, source="trainguard/test")
    finally:
        await nc.close()
