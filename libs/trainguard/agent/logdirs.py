"""Where a launch keeps its logs, and for how long.

Every launch writes under ``<log_root>/<job>/<host>-<UTC stamp>-<pid>``: torchrun's rank
logs, flight-recorder dumps and their requests, warm spares' logs. Left alone they pile up
(one directory per launch, on every host, for every job), so a new launch prunes: for its
job and host it keeps the newest ``keep`` launch directories, and in the whole root it
removes any launch directory untouched for ``max_age_s`` (a finished job's logs too). A
directory whose launcher is still running on this host is never removed, however old.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from trainguard.runtime.pids import pid_running

log = logging.getLogger("trainguard.agent")

DEFAULT_ROOT = "trainguard-logs"
"""Under the system's temporary directory when no ``log_root`` is set."""

_LAUNCH = re.compile(r"^(?P<host>.+)-(?P<stamp>\d{8}T\d{6}Z)-(?P<pid>\d+)$")


@dataclass(frozen=True)
class LaunchDir:
    path: Path
    job: str
    host: str
    pid: int
    mtime: float


def root_of(log_root: str) -> Path:
    return Path(log_root) if log_root else Path(tempfile.gettempdir()) / DEFAULT_ROOT


def create(log_root: str, job: str, host: str, *, now: float | None = None) -> Path:
    """A new launch directory for ``job`` on ``host`` (private to this user: rank logs may
    hold what the trainer prints)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    path = root_of(log_root) / job / f"{host}-{stamp}-{os.getpid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=False)
    return path


def launches(root: Path) -> list[LaunchDir]:
    """Every launch directory under ``root`` (other entries are not the agent's: left)."""
    found: list[LaunchDir] = []
    if not root.is_dir():
        return found
    for job_dir in root.iterdir():
        if not job_dir.is_dir() or job_dir.is_symlink():
            continue
        for entry in job_dir.iterdir():
            m = _LAUNCH.match(entry.name)
            if m is None or not entry.is_dir() or entry.is_symlink():
                continue
            try:
                mtime = _newest_mtime(entry)
            except OSError:
                continue  # removed meanwhile by another host's launch
            found.append(LaunchDir(entry, job_dir.name, m["host"], int(m["pid"]), mtime))
    return found


def _newest_mtime(path: Path) -> float:
    """A launch's last activity: its directory's or any of its files' modification time
    (torchrun writes into nested folders; the top directory's own time stops early)."""
    newest = path.stat().st_mtime
    for dirpath, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                newest = max(newest, os.stat(os.path.join(dirpath, name)).st_mtime)
    return newest


def expired(found: list[LaunchDir], *, job: str, host: str, keep: int, max_age_s: float,
            now: float, running: frozenset[int] = frozenset()) -> list[LaunchDir]:
    """The launch directories to remove (pure): past the newest ``keep`` of ``job`` on
    ``host``, or older than ``max_age_s``; never one of ``running`` (pids of live launchers
    on ``host``, checked by the caller)."""
    ours = sorted((d for d in found if d.job == job and d.host == host),
                  key=lambda d: d.mtime, reverse=True)
    doomed = {d.path for d in ours[keep:]}
    doomed |= {d.path for d in found if now - d.mtime > max_age_s}
    return [d for d in found if d.path in doomed
            and not (d.host == host and d.pid in running)]


def prune(log_root: str, *, job: str, host: str, keep: int, max_age_s: float) -> list[Path]:
    """Remove what :func:`expired` names; returns the removed directories. Errors are
    logged, never raised: pruning must not stop a launch."""
    found = launches(root_of(log_root))
    running = frozenset(d.pid for d in found if d.host == host and pid_running(d.pid))
    removed: list[Path] = []
    for d in expired(found, job=job, host=host, keep=keep, max_age_s=max_age_s,
                     now=time.time(), running=running):
        try:
            shutil.rmtree(d.path)
        except OSError as exc:
            log.warning("could not remove old logs %s: %s", d.path, exc)
            continue
        removed.append(d.path)
    return removed
