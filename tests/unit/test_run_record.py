"""Run records: git state from a real repository, redaction, the diff, ``trainguard runs``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from trainguard.cli import main
from trainguard.contract.runrecord import RUN_FILE
from trainguard.runs import (
    RunRecordError,
    build_manifest,
    collect_run_record,
    diff_records,
    read_run_record,
    write_manifest,
    write_run_record,
)
from trainguard.runs.probes import REDACTED, git_state, relevant_env


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                   cwd=repo, check=True, capture_output=True, timeout=30)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    repo = tmp_path / "code"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    (repo / "train.py").write_text("lr = 0.1\n")
    _git(repo, "add", "train.py")
    _git(repo, "commit", "-q", "-m", "first")
    return repo


def test_git_state_tracks_the_revision_the_dirty_flag_and_the_diff(repo: Path) -> None:
    clean = git_state(repo)
    assert len(clean.revision) == 40 and clean.branch == "main"
    assert not clean.dirty and clean.diff_sha256 == "" and clean.error == ""
    (repo / "untracked.log").write_text("not code")
    assert not git_state(repo).dirty  # untracked files are not the code
    (repo / "train.py").write_text("lr = 0.2\n")
    edited = git_state(repo)
    assert edited.dirty and len(edited.diff_sha256) == 64
    (repo / "train.py").write_text("lr = 0.3\n")
    again = git_state(repo)
    assert again.dirty and again.diff_sha256 != edited.diff_sha256
    assert again.revision == clean.revision


def test_outside_a_work_tree_the_record_says_why(tmp_path: Path) -> None:
    state = git_state(tmp_path)
    assert state.revision == "" and state.error


def test_secrets_are_redacted_and_unrelated_variables_left_out() -> None:
    env = relevant_env({
        "NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "8", "RANK": "3", "HOME": "/root",
        "TRAINGUARD_API_TOKEN": "abc", "HF_TOKEN": "hf_x", "TRAINGUARD_CREDENTIALS": "/c",
        "TRAINGUARD_NATS_CREDS": "/n.creds", "CUDA_SECRET_KEY": "k",
        "TRAINGUARD_REDIS_URL": "redis://user:hunter2@redis:6379/0",
    })
    assert env["NCCL_DEBUG"] == "INFO" and env["OMP_NUM_THREADS"] == "8" and env["RANK"] == "3"
    assert "HOME" not in env
    for name in ("TRAINGUARD_API_TOKEN", "HF_TOKEN", "TRAINGUARD_CREDENTIALS",
                 "TRAINGUARD_NATS_CREDS", "CUDA_SECRET_KEY"):
        assert env[name] == REDACTED
    assert env["TRAINGUARD_REDIS_URL"] == f"redis://{REDACTED}@redis:6379/0"
    assert "hunter2" not in json.dumps(env)


def test_a_record_holds_the_run_and_round_trips(repo: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINGUARD_SOME_TOKEN", "do-not-store")
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.bin").write_bytes(b"abc")
    manifest_file = write_manifest(tmp_path / "m.json", build_manifest([data]))
    record = collect_run_record(seed={"torch": 1, "data": 2}, manifest=manifest_file,
                                config={"optim": {"lr": 0.1}, "layers": [1, 2]}, job="j",
                                repo=repo)
    assert record.git.revision and record.seeds == {"torch": 1, "data": 2}
    assert record.manifest_path == str(manifest_file) and len(record.manifest_id) == 32
    assert "msgspec" in record.packages and record.hardware.cpu_count >= 1
    assert record.environment["python"] and record.env["TRAINGUARD_SOME_TOKEN"] == REDACTED
    written = write_run_record(tmp_path / "step-1", record)
    assert written.name == RUN_FILE and "do-not-store" not in written.read_text()
    assert read_run_record(tmp_path / "step-1") == record
    with pytest.raises(RunRecordError, match="JSON-able"):
        collect_run_record(config={"fn": object()})


def test_the_diff_lists_only_differing_keys(repo: Path) -> None:
    a = collect_run_record(seed=1, config={"optim": {"lr": 0.1, "wd": 0.0}}, repo=repo)
    b = collect_run_record(seed=1, config={"optim": {"lr": 0.2, "wd": 0.0}, "new": True},
                           repo=repo)
    assert diff_records(a, a) == []
    assert diff_records(a, b) == [("config.new", None, True), ("config.optim.lr", 0.1, 0.2)]
    (repo / "train.py").write_text("lr = 0.2\n")
    c = collect_run_record(seed=1, config={"optim": {"lr": 0.1, "wd": 0.0}}, repo=repo)
    assert [k for k, _, _ in diff_records(a, c)] == ["git.diff_sha256", "git.dirty"]


def _layout(root: Path, repo: Path) -> None:
    for step, lr in ((100, 0.1), (200, 0.2)):
        record = collect_run_record(seed=7, config={"lr": lr}, job="llm", repo=repo)
        write_run_record(root / "llm" / f"step-{step}", record)
    (root / "llm" / "step-300").mkdir()  # a checkpoint saved before records were written


def test_runs_show_reads_the_newest_or_the_given_checkpoint(
        repo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "ckpt"
    _layout(root, repo)
    assert main(["runs", "show", "llm", "--root", str(root)]) == 0
    out = capsys.readouterr().out
    assert "step-200/run.json" in out and "lr = 0.2" in out and "seed=7" in out
    monkeypatch.setenv("TRAINGUARD_CHECKPOINT_ROOT", str(root))
    assert main(["runs", "show", "llm", "--step", "100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"] == {"lr": 0.1}
    assert main(["runs", "show", "llm", "--step", "300"]) == 2
    assert "no run record" in capsys.readouterr().err
    assert main(["runs", "show", "other"]) == 2
    monkeypatch.delenv("TRAINGUARD_CHECKPOINT_ROOT")
    assert main(["runs", "show", "llm"]) == 2
    err = capsys.readouterr().err
    assert "--root" in err and "TRAINGUARD_CHECKPOINT_ROOT" in err


def test_runs_diff_takes_job_at_step_and_paths(repo: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ckpt"
    _layout(root, repo)
    assert main(["runs", "diff", "llm@100", str(root / "llm" / "step-200"),
                 "--root", str(root)]) == 1
    out = capsys.readouterr().out
    assert "config.lr: 0.1 -> 0.2" in out and "seeds" not in out and "packages" not in out
    same = str(root / "llm" / "step-100" / RUN_FILE)
    assert main(["runs", "diff", same, same]) == 0
    assert "no differences" in capsys.readouterr().out


def test_the_cli_command_runs_as_a_process(repo: Path, tmp_path: Path) -> None:
    import sys

    root = tmp_path / "ckpt"
    _layout(root, repo)
    libs = Path(__file__).resolve().parents[2] / "libs"
    done = subprocess.run([sys.executable, "-m", "trainguard", "runs", "show", "llm@100",
                           "--root", str(root)], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(libs), "PATH": "/usr/bin:/bin"}, check=False)
    assert done.returncode == 0, done.stderr
    assert "lr = 0.1" in done.stdout
