"""What the coordinator asks of ranks: save-now with a deadline, and the Young/Daly interval.

The ranks are real Guards (the client's command machinery, at_step, acks, too_late) in
threads that step in lockstep through a barrier, as a collective would make them; their
``save_now`` handler writes shard files and reports them the way the Checkpointer does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from tests.conftest import wait_until
from tests.integration.test_checkpointer import Coordinator, coordinator, write_shards
from trainguard import Guard
from trainguard.cli import checkpoints as cli
from trainguard.contract.codec import decode_durable
from trainguard.contract.schemas import Command, Incident
from trainguard.core.auth import load_credentials, write_private
from trainguard.core.connection import flush
from trainguard.core.natsjwt import Permissions
from trainguard.runtime.embedded import EmbeddedControlPlane
from trainguard.runtime.state import Keys, Progress, encode_progress


class Rank(threading.Thread):
    """One stand-in rank: steps in lockstep with its peers, saves when asked."""

    def __init__(self, url: str, prefix: str, job: str, rank: int, world: int, root: Path,
                 barrier: threading.Barrier, *, ignore: bool = False,
                 credentials: str | None = None) -> None:
        super().__init__(name=f"rank-{rank}", daemon=True)
        self.guard = Guard(job=job, rank=rank, world_size=world, host="node-t", nats_url=url,
                           prefix=prefix, heartbeat_interval=0.2, credentials=credentials)
        self.rank, self.world, self.root, self.job = rank, world, root, job
        self.barrier = barrier
        self.ignore = ignore
        self.step = -1
        self.saved: list[int] = []
        self.stop = threading.Event()
        self.guard.on("save_now", self.save_now)

    def save_now(self, cmd: Command) -> str:
        if self.ignore:
            return "ignored"
        step = cmd.at_step if cmd.at_step is not None else self.step
        (rep,) = write_shards(self.root, self.job, step, self.world, ranks=[self.rank]).values()
        self.guard.publish_checkpoint_report(rep)
        self.saved.append(step)
        return f"step={step} saved"

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            with self.guard.step(i):
                time.sleep(0.01)
            self.step = i
            i += 1
            with contextlib.suppress(threading.BrokenBarrierError):
                self.barrier.wait(5)


@contextlib.contextmanager
def ranks(url: str, prefix: str, job: str, root: Path, world: int = 2,
          ignore: tuple[int, ...] = (),
          credentials: dict[int, str] | None = None) -> Iterator[list[Rank]]:
    """``credentials``: each rank's own file (``jwt`` mode)."""
    barrier = threading.Barrier(world)
    group = [Rank(url, prefix, job, r, world, root, barrier, ignore=r in ignore,
                  credentials=(credentials or {}).get(r))
             for r in range(world)]
    for r in group:
        r.start()
    try:
        yield group
    finally:
        for r in group:
            r.stop.set()
        barrier.abort()
        for r in group:
            r.join(10)
            r.guard.close(timeout=2.0)


@contextlib.asynccontextmanager
async def redis_client(url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(url, decode_responses=True)
    try:
        yield client
    finally:
        await client.aclose()


async def write_progress(redis_url: str, prefix: str, job: str, *, last_step: int,
                         step_time: float, world: int = 2) -> None:
    """What the detector writes once a second: the coordinator's source of ``at_step``."""
    async with redis_client(redis_url) as r:
        await r.set(Keys(prefix).progress(job), encode_progress(Progress(
            job=job, time=time.time(), world_size=world, last_step=last_step,
            min_step=last_step, median_step_time=step_time)))


async def commands(c: Coordinator, job: str) -> list[Command]:
    seen: list[Command] = []

    async def on_cmd(msg: Any) -> None:
        seen.append(decode_durable(msg.data, Command))

    await c.bus.nc.subscribe(c.s.cmd_all(job), cb=on_cmd)
    await flush(c.bus.nc)
    return seen


async def test_save_now_retries_too_late_and_returns_the_committed_step(
        nats_url: str, redis_url: str, prefix: str, job: str, tmp_path: Path) -> None:
    await _save_now_retries_too_late(nats_url, redis_url, prefix, job, tmp_path)


@pytest.fixture(scope="module")
def jwt_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedControlPlane]:
    """The embedded servers as ``trainguard up --auth jwt`` runs them: nats-server in
    operator mode, each service with its role's ``.creds``."""
    plane = EmbeddedControlPlane(tmp_path_factory.mktemp("jwt"), secure=True, prefix=JWT_PREFIX,
                                 auth_mode="jwt")
    plane.start()
    try:
        yield plane
    finally:
        plane.stop()


JWT_PREFIX = "tg"


async def test_save_now_in_jwt_mode_with_each_rank_as_itself(
        jwt_plane: EmbeddedControlPlane, job: str, tmp_path: Path) -> None:
    """The same save-now round trip: the coordinator on its role's ``.creds``, each rank
    on a credential that names its own subjects only (minted as the control plane does)."""
    assert jwt_plane.trust is not None
    minter = jwt_plane.trust.minter
    files: dict[int, str] = {}
    for r in range(2):
        files[r] = str(tmp_path / f"rank-{r}.creds")
        write_private(Path(files[r]), minter.mint_rank(JWT_PREFIX, job, r, ttl=600))
    observer = tmp_path / "observer.creds"  # the test's own eyes: every subject
    write_private(observer, minter.mint("test", Permissions((">",), (">",))))
    redis = load_credentials(jwt_plane.credentials["checkpointer"]).redis
    assert redis is not None
    redis_url = (f"redis://{redis.user}:{redis.password}@127.0.0.1:{jwt_plane.redis.port}/0")
    await _save_now_retries_too_late(
        jwt_plane.nats.url, redis_url, JWT_PREFIX, job, tmp_path,
        access={"user_credentials": str(observer)}, rank_credentials=files,
        credentials=str(jwt_plane.credentials["checkpointer"]),
        nats_creds=str(jwt_plane.nats_creds["checkpointer"]))


async def _save_now_retries_too_late(nats_url: str, redis_url: str, prefix: str, job: str,
                                     tmp_path: Path, access: dict[str, Any] | None = None,
                                     rank_credentials: dict[int, str] | None = None,
                                     **settings: Any) -> None:
    async with coordinator(nats_url, redis_url, prefix, job, access, save_margin_steps=2,
                           save_margin_seconds=0.3, **settings) as c:
        sent = await commands(c, job)
        with ranks(nats_url, prefix, job, tmp_path, credentials=rank_credentials) as group:
            await wait_until(lambda: min(r.step for r in group) >= 60, timeout=30,
                             what="ranks past step 60")
            # The detector's newest step lags behind the ranks: the first at_step is late.
            await write_progress(redis_url, prefix, job, last_step=0, step_time=0.01)
            reply = json.loads(await c.rpc("save", {"deadline": 30, "reason": "test"},
                                           timeout=40))
            assert reply["ok"], reply
            assert reply["status"] == "committed" and len(reply["command_ids"]) == 2
            first, retry = sent[0], sent[1]
            assert (first.kind, first.at_step, first.issuer) == ("save_now", 30, "coordinator")
            assert retry.retry_of == first.id and retry.at_step == reply["step"] > 60
            assert all(r.saved == [reply["step"]] for r in group)
            point = await c.resume()
            assert point is not None and point.step == reply["step"]
            assert point.path == reply["path"] == str(tmp_path / job / f"step-{reply['step']}")


async def test_save_now_names_the_rank_that_did_not_report(
        nats_url: str, redis_url: str, prefix: str, job: str, tmp_path: Path) -> None:
    async with coordinator(nats_url, redis_url, prefix, job, commit_deadline=60) as c:
        with ranks(nats_url, prefix, job, tmp_path, ignore=(1,)) as group:
            await wait_until(lambda: min(r.step for r in group) >= 5, what="ranks stepping")
            await write_progress(redis_url, prefix, job, last_step=group[0].step,
                                 step_time=0.01)
            reply = json.loads(await c.rpc("save", {"deadline": 3}, timeout=15))
        assert not reply["ok"] and reply["status"] == "timeout"
        assert reply["missing_ranks"] == [1]
        assert "ranks [1] did not report (reported: [0])" in reply["reason"]
        # Two requests at once share one save.
        both = await asyncio.gather(c.rpc("save", {"deadline": 1}, timeout=10),
                                    c.rpc("save", {"deadline": 1}, timeout=10))
        a, b = (json.loads(x) for x in both)
        assert a["command_ids"] == b["command_ids"] and len(a["command_ids"]) == 1


async def test_interval_follows_cost_and_failures(
        nats_url: str, redis_url: str, prefix: str, job: str, tmp_path: Path) -> None:
    async with coordinator(nats_url, redis_url, prefix, job, mtbf_prior=100.0,
                           interval_min=1.0, interval_max=1000.0, interval_change=0.2,
                           save_margin_steps=2, save_margin_seconds=0.5) as c:
        sent = await commands(c, job)
        await write_progress(redis_url, prefix, job, last_step=100, step_time=0.1)
        # One save that cost the loop 2 s: T = sqrt(2 * 2 s * 100 s) = 20 s = 200 steps.
        await c.report_all(write_shards(tmp_path, job, 100, 2, blocked=2.0))
        await c.event(100, "committed")
        first = (await wait_until(lambda: sent, what="set_interval"))[0]
        assert first.kind == "set_interval" and first.issuer == "coordinator"
        assert first.at_step == 105 and first.params["from_step"] == 106
        assert 195 <= first.params["every_steps"] <= 205
        # A failure halves the MTBF (the prior counts as one): T = sqrt(2*2*50) ~ 14 s.
        await write_progress(redis_url, prefix, job, last_step=150, step_time=0.1)
        await c.bus.publish_durable(c.s.event(job, "incident"), Incident(
            id="inc-1", job=job, cause="process_crash"))
        second = (await wait_until(lambda: sent[1:], what="second set_interval"))[0]
        assert 138 <= second.params["every_steps"] <= 146 and second.at_step == 155
        catalogue = await c.catalogue()
        assert catalogue["interval"]["every_steps"] == second.params["every_steps"]
        assert catalogue["interval"]["failures"] == 1
        # The same incident again (redelivered, or a new revision) is not a new failure.
        await c.bus.publish_durable(c.s.event(job, "incident"), Incident(
            id="inc-1", job=job, cause="process_crash", status="resolved", rev=2))
        await c.report_all(write_shards(tmp_path, job, 110, 2, blocked=2.0))
        await c.event(110, "committed")
        await c.drained()
        assert len(sent) == 2  # the interval did not move by more than 20%


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


async def test_cli_lists_the_catalogue_and_saves(
        nats_url: str, redis_url: str, prefix: str, job: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--job", job, "--nats", nats_url, "--prefix", prefix]
    with pytest.raises(cli.CoordinatorUnavailable, match="no checkpoint coordinator"):
        await asyncio.to_thread(cli.run_checkpoints, parse(["checkpoints", *common]))
    async with coordinator(nats_url, redis_url, prefix, job) as c:
        await c.report_all(write_shards(tmp_path, job, 40, 2))
        await c.event(40, "committed")
        assert await asyncio.to_thread(cli.run_checkpoints, parse(["checkpoints", *common])) == 0
        out = capsys.readouterr().out
        assert f"resume point: step 40 ({tmp_path / job / 'step-40'})" in out
        assert "40    committed  full  2/2" in out
        args = parse(["checkpoints", *common, "--json"])
        assert await asyncio.to_thread(cli.run_checkpoints, args) == 0
        assert json.loads(capsys.readouterr().out)["pointer"]["step"] == 40
        # No ranks are running: the save cannot happen, and the exit code says so.
        args = parse(["save", *common, "--deadline", "1"])
        assert await asyncio.to_thread(cli.run_save, args) == 1
        assert "not saved (timeout): no rank acknowledged save_now" in capsys.readouterr().out
