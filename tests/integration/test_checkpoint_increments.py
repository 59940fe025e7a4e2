"""Incremental checkpoints at the coordinator, against real NATS, Redis and files: an
increment commits only on a committed base, and retention keeps the bases it needs."""

from __future__ import annotations

from pathlib import Path

import msgspec

from tests.conftest import wait_until
from tests.integration.test_checkpointer import coordinator, write_shards
from trainguard.cli.checkpoints import format_catalogue
from trainguard.contract.commit_record import COMMIT_FILE, decode_commit
from trainguard.contract.schemas import CheckpointReport


def increment(reports: dict[int, CheckpointReport], base: int) -> dict[int, CheckpointReport]:
    return {r: msgspec.structs.replace(rep, base=base) for r, rep in reports.items()}


async def test_an_increment_commits_on_its_base_and_keeps_it(
        nats_url: str, redis_url: str, prefix: str, job: str, tmp_path: Path) -> None:
    async with coordinator(nats_url, redis_url, prefix, job, retain=1, delete_files=True) as c:
        # Every rank of step 11 reported before its base: it waits for the base's verdict.
        await c.report_all(increment(write_shards(tmp_path, job, 11, 2), base=10))
        await c.drained()
        entry = await c.entry(11)
        assert entry is not None and (entry["status"], entry["kind"], entry["base"]) == \
            ("pending", "incremental", 10)
        assert c.of(11) == []
        await c.report_all(write_shards(tmp_path, job, 10, 2))
        await c.event(10, "committed")
        await c.event(11, "committed")
        base_entry = await c.entry(10)
        assert base_entry is not None and base_entry["kind"] == "full"
        record = decode_commit((tmp_path / job / "step-11" / COMMIT_FILE).read_bytes())
        assert (record.base, record.base_id) == (10, base_entry["id"])
        assert (await c.resume()).step == 11  # type: ignore[union-attr]

        await c.report_all(increment(write_shards(tmp_path, job, 12, 2), base=10))
        await c.event(12, "committed")
        # retain=1 keeps step 12 only, and step 10, which a restore of it reads.
        await wait_until(lambda: not (tmp_path / job / "step-11").exists(),
                         what="step 11 deleted")
        data = await c.catalogue()
        statuses = {e["step"]: e["status"] for e in data["checkpoints"]}
        assert statuses == {10: "committed", 11: "deleted", 12: "committed"}
        assert (tmp_path / job / "step-10").is_dir()
        table = format_catalogue(data)
        assert "incr of 10" in table and " full " in table

        await c.report_all(write_shards(tmp_path, job, 20, 2))
        await c.event(20, "committed")
        await wait_until(lambda: not (tmp_path / job / "step-10").exists(),
                         what="the old base deleted once nothing needs it")
        assert not (tmp_path / job / "step-12").exists()


async def test_an_increment_on_a_failed_base_fails_and_says_why(
        nats_url: str, redis_url: str, prefix: str, job: str, tmp_path: Path) -> None:
    async with coordinator(nats_url, redis_url, prefix, job, commit_deadline=1.0) as c:
        await c.report_all(increment(write_shards(tmp_path, job, 31, 2), base=30))
        await c.drained()
        base = write_shards(tmp_path, job, 30, 2)
        base[1].ok, base[1].error = False, "disk full"
        await c.report_all(base)
        await c.event(30, "failed")
        failed = await c.event(31, "failed")
        assert "its base, step 30, is not committed (failed)" in failed.reason
        # One whose base never reports fails at its commit deadline.
        await c.report_all(increment(write_shards(tmp_path, job, 41, 2), base=40))
        assert "step 40, is not committed (no record)" in (await c.event(41, "failed")).reason
        assert await c.resume() is None
