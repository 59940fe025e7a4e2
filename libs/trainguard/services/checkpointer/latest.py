"""The coordinator's files beside the checkpoints: ``<root>/<job>/LATEST``, the resume point
for restarts while the bus is down, and ``step-<S>/COMMITTED``, the commit record a rank
checks before it opens a checkpoint (:mod:`trainguard.contract.commit_record`).

Both are written atomically (a temporary file in the same directory, fsync, ``os.replace``, fsync
of the directory), so a reader sees the old pointer or the new one, never half of one.
The directory comes from the checkpoint's own path (``<root>/<job>/step-<S>``): the
coordinator needs no configuration to know where a job's checkpoints live.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import msgspec

from trainguard.contract.commit_record import COMMIT_FILE, CommitRecord, encode_commit
from trainguard.contract.schemas import ResumePoint
from trainguard.core.files import write_atomically

NAME = "LATEST"


def latest_path(checkpoint_path: str) -> Path:
    return Path(checkpoint_path).parent / NAME


def point_path(point_json: str) -> str:
    return msgspec.json.decode(point_json.encode(), type=ResumePoint).path


def write_latest(point_json: str) -> Path:
    """Replace LATEST next to the pointed-to checkpoint with ``point_json``."""
    return write_atomically(latest_path(point_path(point_json)), point_json.encode())


def write_commit(record: CommitRecord) -> Path:
    """Write ``COMMITTED`` into the committed checkpoint's directory."""
    return write_atomically(Path(record.path) / COMMIT_FILE, encode_commit(record))


def remove_latest(old_point_json: str) -> None:
    """No resume point any more (every checkpoint became suspect): LATEST must not keep
    pointing at one, or a restart would resume from it."""
    with contextlib.suppress(FileNotFoundError):
        latest_path(point_path(old_point_json)).unlink()

