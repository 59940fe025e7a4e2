"""Verification of a checkpoint's files against its ranks' reports (real files), and the
one digest both the writer and the verifier compute."""

from __future__ import annotations

import random
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from trainguard.contract.checksum import CHUNK, METADATA_FILE, crc32_of, file_digest
from trainguard.contract.schemas import CheckpointReport, FileDigest
from trainguard.services.checkpointer.verify import verify_checkpoint


def write_checkpoint(root: Path, world: int, size: int = 4096) -> dict[int, CheckpointReport]:
    """Files laid out as DCP writes them, and each rank's honest report of its own."""
    path = root / "job" / "step-10"
    path.mkdir(parents=True)
    reports = {}
    for rank in range(world):
        names = [f"__{rank}_0.distcp"] + ([".metadata"] if rank == 0 else [])
        files = {}
        for i, name in enumerate(names):
            data = bytes((rank * 31 + i + j) % 251 for j in range(size))
            (path / name).write_bytes(data)
            files[name] = FileDigest(bytes=len(data), crc32=zlib.crc32(data))
        reports[rank] = CheckpointReport(id=f"r{rank}", job="job", rank=rank, step=10,
                                         path=str(path), world_size=world, files=files)
    return reports


def test_honest_checkpoint_verifies_in_both_modes(tmp_path: Path) -> None:
    reports = write_checkpoint(tmp_path, 4)
    for mode in ("size", "full"):
        v = verify_checkpoint(reports, 4, mode=mode)
        assert v.ok, v.reason
        assert v.bytes == 5 * 4096


def test_truncated_shard_fails_naming_rank_and_file(tmp_path: Path) -> None:
    reports = write_checkpoint(tmp_path, 4)
    shard = Path(reports[2].path) / "__2_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    v = verify_checkpoint(reports, 4, mode="size")
    assert not v.ok and v.bad_ranks == [2]
    assert "rank 2: __2_0.distcp has 100 bytes, reported 4096" in v.reason


def test_flipped_byte_only_caught_by_full_verification(tmp_path: Path) -> None:
    reports = write_checkpoint(tmp_path, 2)
    shard = Path(reports[1].path) / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[7] ^= 0x01
    shard.write_bytes(bytes(data))
    assert verify_checkpoint(reports, 2, mode="size").ok
    v = verify_checkpoint(reports, 2, mode="full")
    assert not v.ok and v.bad_ranks == [1] and "checksum" in v.reason


def test_missing_file_missing_rank_and_failed_rank(tmp_path: Path) -> None:
    reports = write_checkpoint(tmp_path, 3)
    (Path(reports[0].path) / "__0_0.distcp").unlink()
    v = verify_checkpoint(reports, 3)
    assert not v.ok and "rank 0: __0_0.distcp is missing" in v.reason
    partial = {r: reports[r] for r in (0, 2)}
    v = verify_checkpoint(partial, 3)
    assert not v.ok and v.missing_ranks == [1] and "no report from ranks [1]" in v.reason
    failed = {**partial, 2: CheckpointReport(id="x", job="job", rank=2, step=10,
                                             path=reports[2].path, world_size=3, ok=False,
                                             error="RuntimeError: disk full")}
    v = verify_checkpoint(failed, 3)
    assert not v.ok and v.bad_ranks == [2] and v.missing_ranks == [1]
    assert "rank 2: RuntimeError: disk full" in v.reason


def test_metadata_required_and_names_stay_inside(tmp_path: Path) -> None:
    reports = write_checkpoint(tmp_path, 2)
    del reports[0].files[".metadata"]
    assert "cannot be loaded" in verify_checkpoint(reports, 2).reason
    assert verify_checkpoint(reports, 2, require_metadata=False).ok
    reports[1].files["../../etc/passwd"] = FileDigest(bytes=1)
    v = verify_checkpoint(reports, 2, require_metadata=False)
    assert not v.ok and "leaves the checkpoint" in v.reason


def test_ranks_disagreeing_on_the_path_fail(tmp_path: Path) -> None:
    reports = write_checkpoint(tmp_path, 2)
    reports[1].path = str(tmp_path / "elsewhere")
    assert "different paths" in verify_checkpoint(reports, 2).reason


@pytest.mark.parametrize("size", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 7])
def test_streamed_digest_equals_the_whole_file_crc_across_chunk_edges(tmp_path: Path,
                                                                     size: int) -> None:
    data = random.Random(size).randbytes(size)
    path = tmp_path / "shard"
    path.write_bytes(data)
    assert crc32_of(path) == zlib.crc32(data)
    assert file_digest(path) == FileDigest(bytes=size, crc32=zlib.crc32(data))


def test_what_the_writer_reports_verifies_in_full_mode(tmp_path: Path) -> None:
    """Reports built with the writer's :func:`file_digest` pass the verifier's re-read."""
    reports = write_checkpoint(tmp_path, 2)
    for rep in reports.values():
        rep.files = {name: file_digest(Path(rep.path) / name) for name in rep.files}
    assert METADATA_FILE in reports[0].files
    assert verify_checkpoint(reports, 2, mode="full").ok


def test_the_checksum_module_loads_no_torch() -> None:
    """The coordinator imports it and does not install torch."""
    code = "import sys, trainguard.contract.checksum; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
