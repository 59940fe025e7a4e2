"""Culprits from flight-recorder dumps: the two real 16-rank sets, damaged copies of them,
refused pickles, and small synthetic groups for the wait-for rules."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from pathlib import Path

import pytest

from trainguard.analysis import flightrec
from trainguard.analysis.flightrec import GroupStatus, RankRecord
from trainguard.cli import main

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "flight-recorder"
SETS = ("gpu_error_1st", "lock_gil_1st")


def faulted(name: str) -> list[int]:
    """The ground truth: ``Fault ranks: [..]`` in the set's fault_injection.log."""
    text = (FIXTURES / name / "fault_injection.log").read_text()
    m = re.search(r"Fault ranks:\s*\[([\d,\s]+)\]", text)
    assert m, text
    return sorted(int(r) for r in m.group(1).split(","))


@pytest.mark.parametrize("name", SETS)
def test_real_dumps_name_every_faulted_rank(name: str) -> None:
    a = flightrec.analyse(flightrec.read_dir(str(FIXTURES / name)))
    assert a.ranks == list(range(16))
    assert a.culprits == faulted(name)
    assert a.culprit_groups(), "the groups the culprits hold up are named"
    for g in a.groups:
        assert set(g.behind) <= set(g.ranks)


def test_gpu_error_names_the_rank_whose_device_stopped() -> None:
    """Rank 14's CPU kept enqueueing; only its completions fell behind (what NVIDIA's own
    analysis misses)."""
    a = flightrec.analyse(flightrec.read_dir(str(FIXTURES / "gpu_error_1st")))
    reasons = {g.why[str(r)] for g in a.groups for r in g.behind if r == 14}
    assert reasons and all(w.startswith("completed") for w in reasons)


def test_lock_gil_dumps_with_no_entries_are_reported_empty() -> None:
    a = flightrec.analyse(flightrec.read_dir(str(FIXTURES / "lock_gil_1st")))
    assert a.empty == faulted("lock_gil_1st")


def copy_set(name: str, tmp_path: Path) -> Path:
    dest = tmp_path / name
    shutil.copytree(FIXTURES / name, dest)
    for f in dest.iterdir():
        f.chmod(0o644)
    return dest


def test_a_missing_dump_is_a_culprit_when_its_group_waits_for_it(tmp_path: Path) -> None:
    d = copy_set("lock_gil_1st", tmp_path)
    victim = faulted("lock_gil_1st")[0]
    (d / f"_dump_{victim}").unlink()
    a = flightrec.analyse(flightrec.read_dir(str(d)))
    assert victim in a.missing
    assert a.culprits == faulted("lock_gil_1st")
    assert any(g.why.get(str(victim)) == "no dump" for g in a.groups)


def test_unreadable_dump_is_named_and_treated_as_missing(tmp_path: Path) -> None:
    d = copy_set("gpu_error_1st", tmp_path)
    culprit = faulted("gpu_error_1st")[0]
    (d / f"_dump_{culprit}").write_bytes(b"\x80\x04garbage")
    a = flightrec.analyse(flightrec.read_dir(str(d)))
    assert str(culprit) in a.unreadable
    assert culprit in a.culprits


class Boom:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("echo pwned > /dev/null",))


def test_pickles_with_classes_are_refused() -> None:
    with pytest.raises(flightrec.DumpError, match="refusing"):
        flightrec.loads(pickle.dumps({"pg_status": {}, "entries": [Boom()]}))
    with pytest.raises(flightrec.DumpError, match="not a flight-recorder dump"):
        flightrec.loads(pickle.dumps([1, 2, 3]))


def test_json_dumps_read_like_pickles() -> None:
    raw = (FIXTURES / "lock_gil_1st" / "_dump_8").read_bytes()
    dump = flightrec.loads(raw)
    as_json = json.dumps(dump).encode()
    assert flightrec.summarize(flightrec.loads(as_json), 8) == flightrec.summarize(dump, 8)


def rec(rank: int, **groups: tuple[int, int]) -> RankRecord:
    """A rank's record: group name → (enqueued, completed), members unknown (gloo)."""
    return RankRecord(rank=rank, entries=1, groups={
        n: GroupStatus(name=n, enqueued=e, completed=c) for n, (e, c) in groups.items()})


def test_a_rank_behind_only_because_it_waits_is_a_victim() -> None:
    # Rank 2 never enqueued op 5 of group "a"; rank 1 waits there and so never reached
    # group "b"'s op 8, where rank 0 waits for it.
    records = [rec(0, b=(8, 7)), rec(1, a=(5, 4), b=(7, 7)), rec(2, a=(4, 4))]
    a = flightrec.analyse(records)
    assert a.culprits == [2]
    behind = {g.group: g.behind for g in a.groups}
    assert behind == {"a": [2], "b": [1]}


def test_no_waits_no_culprits() -> None:
    records = [rec(r, **{"0": (10, 10)}) for r in range(4)]
    assert flightrec.analyse(records).culprits == []


def test_ranks_of_the_world_without_a_dump_are_missing() -> None:
    records = [rec(r, **{"0": (3, 2)}) for r in range(3)]
    a = flightrec.analyse(records, expected=range(4))
    assert a.missing == [3]
    assert a.culprits == [3]


def test_mismatched_collectives_are_named() -> None:
    records = [RankRecord(rank=r, entries=1, groups={"g": GroupStatus(
        name="g", enqueued=6, completed=5,
        frontier="gloo:broadcast" if r == 2 else "gloo:all_reduce")}) for r in range(3)]
    (finding,) = flightrec.analyse(records).groups
    assert finding.mismatched == [2]


def test_point_to_point_groups_are_not_compared() -> None:
    records = [RankRecord(rank=r, entries=1, groups={"pp": GroupStatus(
        name="pp", enqueued=100 * (r + 1), completed=100 * (r + 1) - 1, p2p=r == 0)})
        for r in range(2)]
    a = flightrec.analyse(records)
    assert a.culprits == [] and a.skipped_p2p == ["pp"]


@pytest.mark.parametrize("name", SETS)
def test_cli_prints_culprits_as_json(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fr", str(FIXTURES / name), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["culprits"] == faulted(name)


def test_cli_text_names_ranks_and_groups(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fr", str(FIXTURES / "gpu_error_1st")]) == 0
    out = capsys.readouterr().out
    wanted = ", ".join(map(str, faulted("gpu_error_1st")))
    assert f"culprit ranks: {wanted}" in out
    assert "TENSOR_MODEL_PARALLEL_GROUP" in out


def test_cli_refuses_a_directory_without_dumps(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    assert main(["fr", str(tmp_path)]) == 2
    assert "no flight-recorder dumps" in capsys.readouterr().err
    assert main(["fr", str(tmp_path / "absent")]) == 2
