"""Finding a run record in the checkpoint layout, ``<root>/<job>/step-<S>/run.json``.

What ``trainguard runs`` reads: a job's newest checkpoint that has a record, a given step,
or a path a person points at (a ``run.json`` or the checkpoint directory holding it).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from trainguard.contract import envnames
from trainguard.contract.errors import ConfigError
from trainguard.contract.runrecord import RUN_FILE

from .record import RunRecordError

_STEP = re.compile(r"step-(\d+)")
_REF = re.compile(r"(?P<job>[^@/\\]+)(?:@(?P<step>\d+))?")


def checkpoint_root(root: str | os.PathLike[str] | None) -> Path:
    """``root``, else ``TRAINGUARD_CHECKPOINT_ROOT``; neither names both ways to give it."""
    value = os.fspath(root) if root is not None else os.environ.get(envnames.CHECKPOINT_ROOT)
    if not value:
        raise ConfigError(f"no checkpoint root: pass --root ROOT or set "
                          f"{envnames.CHECKPOINT_ROOT} (the directory holding "
                          "<job>/step-<S>/)")
    return Path(value)


def steps(root: Path, job: str) -> list[tuple[int, Path]]:
    """The job's checkpoint directories, oldest step first."""
    try:
        entries = list((root / job).iterdir())
    except FileNotFoundError:
        raise RunRecordError(f"no checkpoints of job {job!r} under {root} "
                             f"({root / job} does not exist)") from None
    found = [(int(m.group(1)), e) for e in entries
             if (m := _STEP.fullmatch(e.name)) and e.is_dir()]
    return sorted(found)


def find_record(root: Path, job: str, step: int | None = None) -> Path:
    """The ``run.json`` of ``step``, or of the newest checkpoint that has one."""
    if step is not None:
        path = root / job / f"step-{step}" / RUN_FILE
        if not path.is_file():
            raise RunRecordError(f"no run record at {path}")
        return path
    listed = steps(root, job)
    for _, directory in reversed(listed):
        if (directory / RUN_FILE).is_file():
            return directory / RUN_FILE
    raise RunRecordError(f"none of job {job!r}'s {len(listed)} checkpoint(s) under {root} "
                         f"has a {RUN_FILE}")


def resolve(ref: str, root: str | os.PathLike[str] | None) -> Path:
    """A ``run.json`` from ``ref``: a path to one (or to a checkpoint directory), else
    ``JOB`` or ``JOB@STEP`` under the checkpoint root."""
    path = Path(ref)
    if path.exists():
        return path / RUN_FILE if path.is_dir() else path
    m = _REF.fullmatch(ref)
    if m is None:
        raise RunRecordError(f"{ref!r} is neither a path nor JOB[@STEP]")
    step = m.group("step")
    return find_record(checkpoint_root(root), m.group("job"),
                       int(step) if step is not None else None)
