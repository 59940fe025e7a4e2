"""A run's record: what produced a checkpoint, written beside it as ``run.json``.

Collected once per process (git and the package list cost tens of milliseconds, too much
for every save) and written by the save group's rank 0 after each save's files are down,
so every checkpoint says which code, packages, hardware, environment, seeds, data and
configuration made it (``trainguard runs show JOB``; ``trainguard runs diff A B``).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from trainguard.contract import envnames
from trainguard.contract.errors import TrainguardError
from trainguard.contract.runrecord import (
    RUN_FILE,
    DatasetManifest,
    RunRecord,
    decode_run_record,
    encode_run_record,
)
from trainguard.core.files import write_atomically
from trainguard.core.identity import environment_record

from .manifest import read_manifest
from .probes import git_state, hardware, packages, relevant_env


class RunRecordError(TrainguardError, ValueError):
    """A run record that cannot be made or read: a config that is not JSON, a missing file."""


def collect_run_record(*, seed: int | Mapping[str, int] | None = None,
                       manifest: DatasetManifest | str | os.PathLike[str] | None = None,
                       config: Mapping[str, Any] | None = None, job: str | None = None,
                       repo: str | os.PathLike[str] | None = None) -> RunRecord:
    """This process's record. ``seed``: one seed or several by name (``{"torch": 1,
    "data": 2}``); ``manifest``: the data set's manifest or its file; ``config``: the
    trainer's configuration (JSON-able: it is stored as given); ``repo``: where the code's
    git work tree is (default: the current directory)."""
    seeds = ({"seed": seed} if isinstance(seed, int) else dict(seed)) if seed is not None \
        else {}
    manifest_id = manifest_path = ""
    if isinstance(manifest, DatasetManifest):
        manifest_id = manifest.id
    elif manifest is not None:
        manifest_path = os.path.abspath(manifest)
        manifest_id = read_manifest(manifest_path).id
    try:
        plain_config = msgspec.to_builtins(dict(config or {}), str_keys=True)
    except (TypeError, ValueError) as exc:
        raise RunRecordError(f"the run's config must be JSON-able: {exc}") from None
    environment = environment_record(seed if isinstance(seed, int) else None)
    return RunRecord(
        job=job if job is not None else os.environ.get(envnames.JOB, ""),
        created_at=time.time(), host=socket.gethostname(), environment=environment,
        git=git_state(repo), packages=packages(), hardware=hardware(), env=relevant_env(),
        seeds=seeds, manifest_id=manifest_id, manifest_path=manifest_path,
        config=plain_config)


def write_run_record(directory: str | os.PathLike[str], record: RunRecord) -> Path:
    """``<directory>/run.json``, written atomically. The Checkpointer calls it on the save
    group's rank 0 once a save's files are written, with the record collected at start."""
    return write_atomically(Path(directory) / RUN_FILE, encode_run_record(record))


def read_run_record(path: str | os.PathLike[str]) -> RunRecord:
    """The record in ``path``: a ``run.json`` or a checkpoint directory holding one."""
    p = Path(path)
    if p.is_dir():
        p = p / RUN_FILE
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise RunRecordError(f"no run record at {p} (checkpoints saved before run records "
                             "were written have none)") from None
    return decode_run_record(data)
