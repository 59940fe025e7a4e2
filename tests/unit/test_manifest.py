"""Dataset manifests on real files: ids, checks in both depths, sampled mode, the CLI."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainguard.cli import main
from trainguard.contract.errors import DecodeError
from trainguard.contract.runrecord import decode_manifest, encode_manifest
from trainguard.runs import (
    DataMismatch,
    ManifestError,
    build_manifest,
    check_data,
    read_manifest,
    verify,
    write_manifest,
)
from trainguard.runs.hashing import sample_offsets

MIB = 1024 * 1024


def _tree(root: Path) -> Path:
    data = root / "data"
    (data / "shards").mkdir(parents=True)
    for i in range(5):
        (data / "shards" / f"part-{i}.bin").write_bytes(os.urandom(100_000 + i))
    (data / "meta.json").write_text('{"rows": 5}')
    return data


def _kinds(mismatches: list) -> list[tuple[str, str]]:
    return [(m.path, m.kind) for m in mismatches]


def test_the_id_is_stable_across_builds_and_file_order(tmp_path: Path) -> None:
    data = _tree(tmp_path)
    first = build_manifest([data], workers=1)
    second = build_manifest([data], workers=8)
    assert first.id == second.id and len(first.files) == 6
    assert [e.path for e in first.files] == sorted(e.path for e in first.files)
    # the same files in a copy made in another order (other inodes, other times): same id
    copy = tmp_path / "copy"
    for entry in reversed(first.files):
        (copy / entry.path).parent.mkdir(parents=True, exist_ok=True)
        (copy / entry.path).write_bytes((data / entry.path).read_bytes())
    assert build_manifest([copy]).id == first.id
    assert verify(first, copy, mode="full") == []


def test_one_changed_byte_changes_the_id_and_a_full_check_names_the_file(
        tmp_path: Path) -> None:
    data = _tree(tmp_path)
    before = build_manifest([data])
    target = data / "shards" / "part-3.bin"
    raw = bytearray(target.read_bytes())
    raw[50_000] ^= 1
    target.write_bytes(bytes(raw))
    assert build_manifest([data]).id != before.id
    assert verify(before, mode="quick") == []  # same size: only a full check reads it
    assert _kinds(verify(before, mode="full")) == [("shards/part-3.bin", "content")]


def test_truncated_removed_and_added_files_are_named(tmp_path: Path) -> None:
    data = _tree(tmp_path)
    manifest = build_manifest([data])
    with open(data / "shards" / "part-1.bin", "r+b") as fh:
        fh.truncate(10)
    (data / "shards" / "part-2.bin").unlink()
    (data / "shards" / "part-9.bin").write_bytes(b"new")
    found = verify(manifest)
    assert _kinds(found) == [("shards/part-1.bin", "size"), ("shards/part-2.bin", "missing"),
                             ("shards/part-9.bin", "added")]
    with pytest.raises(DataMismatch) as info:
        check_data(manifest, policy="refuse")
    message = str(info.value)
    assert "shards/part-1.bin size 100001 -> 10" in message
    assert "shards/part-2.bin missing" in message and "trainguard data manifest" in message
    assert check_data(manifest, policy="alert") == found  # alert: returned, not raised


def test_sampled_mode_catches_a_size_change_and_a_change_in_a_sampled_block(
        tmp_path: Path) -> None:
    data = tmp_path / "big"
    data.mkdir()
    big = data / "big.bin"
    big.write_bytes(os.urandom(6 * MIB))
    manifest = build_manifest([data], sample=3)
    assert manifest.mode == "sampled" and manifest.sample_blocks == 3
    assert manifest.id != build_manifest([data]).id  # the mode is part of the id
    offsets = sample_offsets(6 * MIB, 3)
    assert offsets == [0, 5 * MIB // 2, 5 * MIB]
    raw = bytearray(big.read_bytes())
    raw[offsets[1] + 10] ^= 0xFF  # inside the middle block
    big.write_bytes(bytes(raw))
    assert _kinds(verify(manifest)) == [("big.bin", "content")]  # quick re-samples
    raw[offsets[1] + 10] ^= 0xFF
    raw[MIB + 5] ^= 0xFF  # between blocks: what sampling gives up
    big.write_bytes(bytes(raw))
    assert verify(manifest, mode="full") == []
    with open(big, "ab") as fh:
        fh.write(b"appended")
    assert _kinds(verify(manifest)) == [("big.bin", "size")]


def test_a_small_file_is_hashed_whole_in_sampled_mode(tmp_path: Path) -> None:
    data = _tree(tmp_path)
    manifest = build_manifest([data], sample=4)
    target = data / "meta.json"
    target.write_text('{"rows": 6}')  # same size, different byte
    assert _kinds(verify(manifest)) == [("meta.json", "content")]


def test_symlinks_are_followed_and_cycles_cut(tmp_path: Path) -> None:
    data = _tree(tmp_path)
    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes(b"linked data")
    (data / "linked.bin").symlink_to(outside)
    (data / "shards" / "loop").symlink_to(data)  # a cycle back to the top
    manifest = build_manifest([data])
    paths = [e.path for e in manifest.files]
    assert "linked.bin" in paths
    assert all(not p.startswith("shards/loop/shards/loop") for p in paths)
    (data / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ManifestError, match="broken symlink"):
        build_manifest([data])
    assert verify(manifest) == []  # a check ignores a link that names nothing


def test_several_inputs_share_one_root(tmp_path: Path) -> None:
    data = _tree(tmp_path)
    manifest = build_manifest([data / "shards", data / "meta.json"])
    assert manifest.root == str(data) and manifest.inputs == ["meta.json", "shards"]
    (data / "unlisted.txt").write_text("not part of the set")
    assert verify(manifest) == []  # only the inputs are walked for added files


def test_the_file_round_trips_and_refuses_an_unknown_version(tmp_path: Path) -> None:
    manifest = build_manifest([_tree(tmp_path)])
    path = write_manifest(tmp_path / "m.json", manifest)
    assert read_manifest(path) == manifest
    newer = encode_manifest(manifest).replace(b'"version": 1', b'"version": 99')
    with pytest.raises(DecodeError, match="version 99"):
        decode_manifest(newer)
    with pytest.raises(ManifestError, match="trainguard data manifest"):
        read_manifest(tmp_path / "absent.json")


def test_the_cli_writes_a_manifest_and_verifies_data(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _tree(tmp_path)
    out = tmp_path / "m.json"
    assert main(["data", "manifest", str(data), "-o", str(out)]) == 0
    manifest = read_manifest(out)
    assert manifest.id in capsys.readouterr().out
    assert main(["data", "manifest", "--verify", str(out), "--full"]) == 0
    capsys.readouterr()
    (data / "meta.json").unlink()
    assert main(["data", "manifest", "--verify", str(out)]) == 1
    captured = capsys.readouterr()
    assert "missing" in captured.out and "meta.json" in captured.out
    assert main(["data", "manifest", "--verify", str(tmp_path / "none.json")]) == 2
    assert main(["data", "manifest", str(data)]) == 0  # to stdout: the JSON itself
    captured = capsys.readouterr()
    assert decode_manifest(captured.out.encode()).files and "manifest" in captured.err


def test_a_missing_hasher_is_named_with_the_fix() -> None:
    from trainguard.cli.extras import explain

    err = explain(ModuleNotFoundError("No module named 'xxhash'", name="xxhash"),
                  "trainguard data")
    assert err is not None and "pip install trainguard" in str(err) and "xxhash" in str(err)
