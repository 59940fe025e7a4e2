"""The agent's log directories: one per job under a configurable root, pruned past the
newest ``log_keep`` of a job and host and past ``log_max_age_h``, never while in use."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainguard.agent import logdirs
from trainguard.agent.settings import AgentSettings
from trainguard.contract.errors import ConfigError
from trainguard.runtime.config import load_settings


def _launch(root: Path, job: str, host: str, pid: int, age_s: float, stamp: int) -> Path:
    path = root / job / f"{host}-2026010{stamp % 10}T00000{stamp % 10}Z-{pid}"
    (path / "attempt_0").mkdir(parents=True)
    log = path / "attempt_0" / "stdout.log"
    log.write_text("a rank's output\n")
    then = time.time() - age_s
    for p in (log, path / "attempt_0", path):
        os.utime(p, (then, then))
    return path


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(proc.stdout)


def test_a_launch_gets_its_own_directory_under_its_job(tmp_path: Path) -> None:
    first = logdirs.create(str(tmp_path), "job-a", "node-1", now=0)
    second = logdirs.create(str(tmp_path), "job-a", "node-1", now=60)
    assert first.parent == second.parent == tmp_path / "job-a"
    assert first != second and first.name.startswith("node-1-") and first.is_dir()
    assert oct(first.stat().st_mode & 0o777) == oct(0o700)
    assert {d.path for d in logdirs.launches(tmp_path)} == {first, second}


def test_the_default_root_is_one_folder_in_the_temporary_directory() -> None:
    assert logdirs.root_of("").name == logdirs.DEFAULT_ROOT
    assert logdirs.root_of("/var/log/tg") == Path("/var/log/tg")


def test_prune_keeps_the_newest_of_the_job_and_host_and_drops_the_old(tmp_path: Path) -> None:
    dead = _dead_pid()
    mine = [_launch(tmp_path, "job-a", "node-1", dead, age_s=100 * i, stamp=i)
            for i in range(5)]
    other_host = _launch(tmp_path, "job-a", "node-2", dead, age_s=1000, stamp=6)
    other_job_fresh = _launch(tmp_path, "job-b", "node-1", dead, age_s=1000, stamp=7)
    other_job_stale = _launch(tmp_path, "job-b", "node-1", dead, age_s=10 * 86400, stamp=8)
    (tmp_path / "job-b" / "notes.txt").write_text("not a launch")
    removed = logdirs.prune(str(tmp_path), job="job-a", host="node-1", keep=2,
                            max_age_s=7 * 86400)
    assert set(removed) == {*mine[2:], other_job_stale}
    assert all(p.is_dir() for p in (*mine[:2], other_host, other_job_fresh))
    assert not any(p.exists() for p in removed)
    assert (tmp_path / "job-b" / "notes.txt").exists()


def test_a_directory_in_use_is_kept_however_old(tmp_path: Path) -> None:
    live = _launch(tmp_path, "job-a", "node-1", os.getpid(), age_s=30 * 86400, stamp=1)
    elsewhere = _launch(tmp_path, "job-a", "node-9", os.getpid(), age_s=30 * 86400, stamp=2)
    removed = logdirs.prune(str(tmp_path), job="job-a", host="node-1", keep=0,
                            max_age_s=3600)
    assert live.is_dir()
    # The pid is only known alive for this host's launches; another host's is judged by age.
    assert removed == [elsewhere]


def test_new_files_keep_a_launch_fresh(tmp_path: Path) -> None:
    dead = _dead_pid()
    launch = _launch(tmp_path, "job-a", "node-1", dead, age_s=30 * 86400, stamp=1)
    (launch / "attempt_0" / "stdout.log").write_text("still writing\n")  # now
    assert logdirs.prune(str(tmp_path), job="job-b", host="node-1", keep=1,
                         max_age_s=3600) == []


def test_a_missing_root_prunes_nothing(tmp_path: Path) -> None:
    assert logdirs.prune(str(tmp_path / "none"), job="j", host="h", keep=1,
                         max_age_s=1) == []


@pytest.mark.parametrize(("env", "key"), [({"TRAINGUARD_LOG_KEEP": "0"}, "log_keep"),
                                          ({"TRAINGUARD_LOG_MAX_AGE_H": "-1"}, "log_max_age_h")])
def test_bad_retention_settings_name_the_key(env: dict[str, str], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        load_settings(AgentSettings, env=env)


def test_the_log_root_comes_from_the_environment() -> None:
    settings = load_settings(AgentSettings, env={"TRAINGUARD_LOG_ROOT": "/srv/tg-logs"})
    assert settings.log_root == "/srv/tg-logs"
