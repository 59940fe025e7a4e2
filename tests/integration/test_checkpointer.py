"""The checkpoint coordinator against real servers and real files.

Ranks are stood in for by reports published exactly as ``Checkpointer`` publishes them,
about files really written under ``tmp_path`` (the end-to-end tests use real DCP).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest

from tests.conftest import wait_until
from tests.integration.recorder import running
from trainguard import Guard
from trainguard.contract.codec import decode_durable
from trainguard.contract.commit_record import COMMIT_FILE, decode_commit
from trainguard.contract.envelope import uuid7
from trainguard.contract.schemas import (
    Anomaly,
    CheckpointCommitted,
    CheckpointReport,
    DeadLetter,
    FileDigest,
    ResumePoint,
)
from trainguard.contract.subjects import Subjects
from trainguard.core.connection import flush
from trainguard.runtime.bus import Bus
from trainguard.runtime.config import load_settings
from trainguard.runtime.topology import provision, stream_name, streams
from trainguard.services.checkpointer.service import CheckpointerService
from trainguard.services.checkpointer.settings import CheckpointerSettings


def coordinator_settings(nats_url: str, redis_url: str, prefix: str,
                         **extra: Any) -> CheckpointerSettings:
    overrides = {"nats_url": nats_url, "redis_url": redis_url, "prefix": prefix,
                 "tick": 0.1, **extra}
    return load_settings(CheckpointerSettings, env={}, overrides=overrides)


def write_shards(root: Path, job: str, step: int, world: int, *, size: int = 2048,
                 blocked: float = 0.05, ranks: list[int] | None = None,
                 attempt: int = 0, state_since: float = 0.0) -> dict[int, CheckpointReport]:
    """Write ``<root>/<job>/step-<S>/`` as DCP lays it out and return each rank's report."""
    path = root / job / f"step-{step}"
    path.mkdir(parents=True, exist_ok=True)
    reports = {}
    for rank in ranks if ranks is not None else range(world):
        names = [f"__{rank}_0.distcp"] + ([".metadata"] if rank == 0 else [])
        files = {}
        for i, name in enumerate(names):
            data = bytes((step + rank * 7 + i + j) % 253 for j in range(size))
            (path / name).write_bytes(data)
            files[name] = FileDigest(bytes=len(data), crc32=zlib.crc32(data))
        reports[rank] = CheckpointReport(
            id=uuid7(), job=job, rank=rank, step=step, path=str(path), world_size=world,
            bytes=sum(f.bytes for f in files.values()), seconds_blocked=blocked,
            seconds_total=blocked * 3, files=files, attempt=attempt, time=time.time(),
            state_since=state_since)
    return reports


class Coordinator:
    """A running coordinator plus what a test needs to talk to it."""

    def __init__(self, bus: Bus, prefix: str, job: str) -> None:
        self.bus = bus
        self.s = Subjects(prefix)
        self.job = job
        self.events: list[CheckpointCommitted] = []
        self.dead: list[DeadLetter] = []

    async def report(self, rep: CheckpointReport) -> None:
        await self.bus.publish_durable(self.s.ckpt(rep.job, rep.rank), rep)

    async def report_all(self, reports: dict[int, CheckpointReport]) -> None:
        for rep in reports.values():
            await self.report(rep)

    async def rpc(self, name: str, body: dict[str, Any] | None = None,
                  timeout: float = 5.0) -> bytes:
        payload = json.dumps(body).encode() if body is not None else b""
        reply = await self.bus.nc.request(self.s.rpc(self.job, name), payload, timeout=timeout)
        return bytes(reply.data)

    async def catalogue(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(await self.rpc("checkpoints"))
        return data

    async def entry(self, step: int) -> dict[str, Any] | None:
        for c in (await self.catalogue())["checkpoints"]:
            if c["step"] == step:
                return dict(c)
        return None

    async def resume(self) -> ResumePoint | None:
        data = await self.rpc("resume")
        return decode_durable(data, ResumePoint) if data else None

    def of(self, step: int, status: str | None = None) -> list[CheckpointCommitted]:
        return [e for e in self.events if e.step == step and status in (None, e.status)]

    async def event(self, step: int, status: str, timeout: float = 10.0) -> CheckpointCommitted:
        found = await wait_until(lambda: self.of(step, status), timeout=timeout,
                                 what=f"{status} event for step {step}")
        event: CheckpointCommitted = found[0]
        return event

    async def drained(self) -> None:
        """Every report published so far has been handled (a real sync point)."""
        js = self.bus.js
        stream = stream_name(self.s.prefix, "reports")

        async def idle() -> bool:
            info = await js.consumer_info(stream, "checkpointer")
            return info.num_pending == 0 and info.num_ack_pending == 0

        await wait_until(idle, what="reports handled")


@contextlib.asynccontextmanager
async def coordinator(nats_url: str, redis_url: str, prefix: str, job: str,
                      access: dict[str, Any] | None = None,
                      **extra: Any) -> AsyncIterator[Coordinator]:
    """``access``: the test's own connection options (on a server with auth)."""
    nc = await nats.connect(nats_url, **(access or {}))
    s = Subjects(prefix)
    await provision(nc.jetstream(), streams(prefix))
    c = Coordinator(Bus(nc, s, source="trainguard/test"), prefix, job)

    async def on_event(msg: Any) -> None:
        c.events.append(decode_durable(msg.data, CheckpointCommitted))

    async def on_dead(msg: Any) -> None:
        c.dead.append(decode_durable(msg.data, DeadLetter))

    await nc.subscribe(s.event(job, "checkpoint"), cb=on_event)
    await nc.subscribe(s.dead(job), cb=on_dead)
    await flush(nc)
    try:
        async with running(CheckpointerService(
                coordinator_settings(nats_url, redis_url, prefix, **extra))):
            yield c
    finally:
        await nc.close()


def latest(root: Path, job: str) -> ResumePoint | None:
    path = root / job / "LATEST"
    return decode_durable(path.read_bytes(), ResumePoint) if path.exists() else None


async def test_four_ranks_commit_only_after_the_fourth_report(
        nats_url: str, redis_url: str, prefix: str, job: str, tmp_path: Path) -> None:
    async with coordinator(nats_url, redis_url, prefix, job) as c:
        reports = write_shards(tmp_path, job, 100, 4)
        for rank in (0, 1, 2):
            await c.report(reports[rank])
        pending = await wait_until(lambda: _reported(c, 100, [0, 1, 2]), what="3 of 4 recorded")
        assert pending["status"] == "pending" and pending["missing_ranks"] == [3]
        assert c.events == [] and await c.resume() is None
        assert latest(tmp_path, job) is None

        await c.report(reports[3])
        event = await c.event(100, "committed")
        assert (event.world_size, event.missing_ranks) == (4, [])
        assert event.bytes == sum(r.bytes for r in reports.values())
        point = await c.resume()
        assert point is not None and (point.step, point.path) == (100, reports[0].path)
        assert point.checkpoint_id == event.id and point.world_size == 4
        assert latest(tmp_path, job) == point  # LATEST mirrors the pointer
        # The commit record vouches for the directory, with every rank's digests; one lost
        # (or from before records existed) is written again when a rank asks.
        record_path = Path(point.path) / COMMIT_FILE
        record = decode_commit(record_path.read_bytes())
        assert (record.job, record.step) == (job, 100)
        assert set(record.files) == {n for r in reports.values() for n in r.files}
        record_path.unlink()
        assert await c.resume() == point
        assert decode_commit(record_path.read_bytes()).files == record.files
        # A report delivered again changes nothing: one event per checkpoint.
        await c.report(reports[3])
        await c.drained()
        assert len(c.of(100)) == 1


async def _reported(c: Coordinator, step: int, ranks: list[int]) -> dict[str, Any] | None:
    entry = await c.entry(step)
    return entry if entry is not None and entry["reported"] == ranks else None


async def test_a_withheld_report_fails_the_checkpoint_naming_the_rank(
        nats_url: str, redis_url: str, prefix: str, job: str, tmp_path: Path) -> None:
    async with coordinator(nats_url, redis_url, prefix, job, commit_deadline=1.5) as c:
        good = write_shards(tmp_path, job, 50, 4)
        await c.report_all(good)
        await c.event(50, "committed")
        reports = write_shards(tmp_path, job, 100, 4)
        for rank in (0, 1, 3):
            await c.report(reports[rank])
        await wait_until(lambda: _reported(c, 100, [0, 1, 3]), what="3 of 4 recorded")
        assert c.of(100) == []  # still waiting for rank 2, within the deadline
        failed = await c.event(100, "failed")
        assert failed.missing_ranks == [2] and "[2]" in failed.reason
        point = await c.resume()
        assert point is not None and point.step == 50  # never a failed checkpoint
        # Rank 2's late report does not revive it.
        await c.report(reports[2])
        await c.drained()
        entry = await c.entry(100)
        assert entry is not None and entry["status"] == "failed"
        assert len(c.of(100)) == 1 and (await c.resume()) == point
        # The job saves step 100 again later: a new round, whoever reports first.
        again = write_shards(tmp_path, job, 100, 4, blocked=0.001)
        await c.report(again[2])
        await c.report_all({r: again[r] for r in (0, 1, 3)})
        await c.event(100, "committed")
        assert (await c.resume()).step == 100  # type: ignore[union-attr]


@pytest.mark.parametrize("verify", ["size", "full"])
async def test_damaged_shards_never_commit(nats_url: str, redis_url: str, prefix: str,
                                           job: str, tmp_path: Path, verify: str) -> None:
    async with coordinator(nats_url, redis_url, prefix, job, verify=verify) as c:
        truncated = write_shards(tmp_path, job, 10, 2)
        shard = Path(truncated[1].path) / "__1_0.distcp"
        shard.write_bytes(shard.read_bytes()[:-1])
        await c.report_all(truncated)
        event = await c.event(10, "failed")
        assert "rank 1: __1_0.distcp has 2047 bytes, reported 2048" in event.reason

        flipped = write_shards(tmp_path, job, 20, 2)
        shard = Path(flipped[0].path) / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        data[100] ^= 0x40
        shard.write_bytes(bytes(data))
        await c.report_all(flipped)
        if verify == "full":
            event = await c.event(20, "failed")
            assert "rank 0: __0_0.distcp checksum" in event.reason
            assert await c.resume() is None
        else:  # same size: only a full verification reads the bytes
            await c.event(20, "committed")


async def test_failed_rank_report_fails_at_once(nats_url: str, redis_url: str, prefix: str,
                                                job: str, tmp_path: Path) -> None:
    async with coordinator(nats_url, redis_url, prefix, job) as c:
        reports = write_shards(tmp_path, job, 7, 3, ranks=[0])
        await c.report(reports[0])
        await c.report(CheckpointReport(
            id=uuid7(), job=job, rank=2, step=7, path=reports[0].path, world_size=3, ok=False,
            error="RuntimeError: Timed out waiting 5000ms for send operation", time=time.time()))
        event = await c.event(7, "failed")
        assert event.missing_ranks == [1]
        assert "rank 2: RuntimeError: Timed out" in event.reason


async def test_resume_suspects_and_rollback(nats_url: str, redis_url: str, prefix: str,
                                            job: str, tmp_path: Path) -> None:
    async with coordinator(nats_url, redis_url, prefix, job) as c:
        for step in (10, 20, 30):
            await c.report_all(write_shards(tmp_path, job, step, 2))
            await c.event(step, "committed")
        guard = Guard(job=job, rank=0, world_size=1, host="h", nats_url=nats_url,
                      prefix=prefix, heartbeat_interval=60)
        try:
            point = await asyncio.to_thread(guard.resume_point)
        finally:
            guard.close(timeout=1.0)
        assert point is not None and point.step == 30

        # A NaN that began at step 25: the checkpoint of step 30 holds it.
        await c.bus.publish_durable(c.s.event(job, "anomaly"), Anomaly(
            id="nan-1", job=job, kind="nonfinite", step=25, onset_at=time.time() - 5,
            detected_at=time.time()))
        suspect = await c.event(30, "suspect")
        assert "nonfinite" in suspect.reason and "nan-1" in suspect.reason
        assert (await c.resume()).step == 20  # type: ignore[union-attr]
        assert latest(tmp_path, job).step == 20  # type: ignore[union-attr]
        # Committed while the onset is open: complete, but never the pointer.
        await c.report_all(write_shards(tmp_path, job, 40, 2))
        await c.event(40, "suspect")
        assert (await c.resume()).step == 20  # type: ignore[union-attr]

        # The remediator rolls back below the onset step it diagnosed.
        reply = json.loads(await c.rpc("rollback", {"below_step": 20, "reason": "numeric"}))
        assert reply["ok"] and reply["step"] == 10 and reply["suspect_steps"] == [20]
        assert reply["point"]["path"] == str(tmp_path / job / "step-10")
        assert latest(tmp_path, job).step == 10  # type: ignore[union-attr]
        await c.event(20, "suspect")
        catalogue = await c.catalogue()
        assert catalogue["pin"] == 10 and catalogue["onsets"] == {}
        statuses = {e["step"]: e["status"] for e in catalogue["checkpoints"]}
        assert statuses == {10: "committed", 20: "suspect", 30: "suspect", 40: "suspect"}

        # After the restart the job saves step 20 again: a clean commit, the new pointer.
        await c.report_all(write_shards(tmp_path, job, 20, 2, attempt=1,
                                        state_since=time.time()))
        await wait_until(lambda: len(c.of(20, "committed")) == 2, what="step 20 re-committed")
        assert (await c.resume()).step == 20  # type: ignore[union-attr]
        # A rollback with nothing below leaves no pointer, and no LATEST to resume from.
        reply = json.loads(await c.rpc("rollback", {"below_step": 5}))
        assert not reply["ok"] and "no committed" in reply["reason"]
        assert await c.resume() is None and latest(tmp_path, job) is None


async def test_after_a_rollback_only_state_restored_since_is_trusted_past_its_step(
        nats_url: str, redis_url: str, prefix: str, job: str, tmp_path: Path) -> None:
    """The ranks on the bad state go on saving until their reload or restart reaches them:
    such a save, begun after the rollback, must not become the pointer the restart loads."""
    async with coordinator(nats_url, redis_url, prefix, job) as c:
        for step in (10, 20):
            await c.report_all(write_shards(tmp_path, job, step, 2))
            await c.event(step, "committed")
        started = time.time() - 60  # the processes' state, made long before the rollback
        reply = json.loads(await c.rpc("rollback", {"below_step": 15, "reason": "numeric"}))
        assert reply["ok"] and reply["step"] == 10

        # Step 30 from the old state, saved after the rollback was decided.
        stale = write_shards(tmp_path, job, 30, 2, state_since=started)
        await c.report_all(stale)
        event = await c.event(30, "suspect")
        assert "older than the rollback below step 15" in event.reason
        assert (await c.resume()).step == 10  # type: ignore[union-attr]

        # One rank restored, the other not yet: still the old state.
        mixed = write_shards(tmp_path, job, 40, 2, state_since=time.time())
        mixed[1] = write_shards(tmp_path, job, 40, 2, ranks=[1], state_since=started)[1]
        await c.report_all(mixed)
        await c.event(40, "suspect")

        # Every rank reloaded step 10 after the rollback: its saves are trusted again.
        await c.report_all(write_shards(tmp_path, job, 20, 2, attempt=1,
                                        state_since=time.time()))
        await wait_until(lambda: len(c.of(20, "committed")) == 2, what="step 20 re-committed")
        assert (await c.resume()).step == 20  # type: ignore[union-attr]


async def test_retention_keeps_newest_and_pinned_and_deletes_only_when_asked(
        nats_url: str, redis_url: str, prefix: str, job: str, tmp_path: Path) -> None:
    async with coordinator(nats_url, redis_url, prefix, job, retain=2, delete_files=True,
                           commit_deadline=1.0) as c:
        for step in (10, 20, 30):
            await c.report_all(write_shards(tmp_path, job, step, 2))
            await c.event(step, "committed")
        reply = json.loads(await c.rpc("rollback", {"below_step": 30}))
        assert reply["step"] == 20
        failed = write_shards(tmp_path, job, 35, 2, ranks=[0])
        await c.report_all(failed)
        await c.event(35, "failed")
        for step in (40, 50):
            await c.report_all(write_shards(tmp_path, job, step, 2, attempt=1))
            await c.event(step, "committed")
        await wait_until(lambda: not (tmp_path / job / "step-30").exists(),
                         what="step 30 deleted")
        statuses = {e["step"]: e["status"] for e in (await c.catalogue())["checkpoints"]}
        assert statuses == {10: "deleted", 20: "committed", 30: "deleted", 35: "failed",
                            40: "committed", 50: "committed"}
        assert not (tmp_path / job / "step-10").exists()
        # 40 and 50 are the newest two, 20 is pinned, 35 never committed: their files stay.
        for step in (20, 35, 40, 50):
            assert (tmp_path / job / f"step-{step}").is_dir()


async def test_reports_that_cannot_be_checkpoints_are_dead_lettered(
        nats_url: str, redis_url: str, prefix: str, job: str, tmp_path: Path) -> None:
    async with coordinator(nats_url, redis_url, prefix, job) as c:
        rep = write_shards(tmp_path, job, 3, 1)[0]
        rep.path = str(tmp_path / "somewhere-else")
        await c.report(rep)
        dead = await wait_until(lambda: c.dead, what="dead letter")
        assert "is not <root>/" in dead[0].reason
        assert msgspec.json.decode(dead[0].payload)["id"] == rep.id


async def test_two_replicas_commit_each_checkpoint_once(
        nats_url: str, redis_url: str, prefix: str, job: str, tmp_path: Path) -> None:
    async with coordinator(nats_url, redis_url, prefix, job) as c, \
            running(CheckpointerService(coordinator_settings(nats_url, redis_url, prefix))):
        batches = [write_shards(tmp_path, job, step, 4) for step in range(1, 7)]
        await asyncio.gather(*(c.report_all(b) for b in batches))
        for step in range(1, 7):
            await c.event(step, "committed")
        await c.drained()
        assert sorted(e.step for e in c.events) == list(range(1, 7))
        assert (await c.resume()).step == 6  # type: ignore[union-attr]
