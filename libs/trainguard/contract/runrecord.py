"""Dataset manifests and run records: what a job trained on and what it ran with.

Both are JSON files a person and a later process read: a manifest (``trainguard data
manifest``) lists a data set's files with their sizes and content hashes; a run record
(``run.json`` beside every checkpoint, ``trainguard runs show``) says which code, packages,
hardware, environment, seeds, data and configuration produced it. The vocabularies (modes,
mismatch kinds, policies) live here so that the writer, the CLI and a job that checks its
data agree on them. Each file carries a ``version``: a reader refuses one it does not know.
"""

from __future__ import annotations

from typing import Any, Final, Literal, TypeVar, get_args

import msgspec

from .errors import DecodeError

MANIFEST_VERSION: Final = 1
RUN_RECORD_VERSION: Final = 1
RUN_FILE: Final = "run.json"
"""The run record's name in a checkpoint directory (``<root>/<job>/step-<S>/run.json``)."""
HASH_ALGORITHM: Final = "xxh3_128"
"""Full-mode digests are XXH3-128 of the content (``xxh128sum`` prints the same)."""

ManifestMode = Literal["full", "sampled"]
"""``full``: every byte hashed. ``sampled``: ``sample_blocks`` blocks of ``block_size``
bytes at fixed offsets, with the size (:mod:`trainguard.runs.hashing` says how)."""
MismatchKind = Literal["missing", "added", "size", "content", "unreadable"]
MISMATCH_KINDS: frozenset[str] = frozenset(get_args(MismatchKind))
DataPolicy = Literal["refuse", "alert"]
"""What a job does when its data differs from its manifest: refuse to start, or go on and
raise an alert with the differing files."""
DATA_POLICIES: frozenset[str] = frozenset(get_args(DataPolicy))

V = TypeVar("V", "DatasetManifest", "RunRecord")


class ManifestEntry(msgspec.Struct, kw_only=True):
    path: str
    """Relative to the manifest's root, ``/``-separated."""
    size: int
    mtime_ns: int = 0
    """Informational: a copy to another host changes it, so no check compares it."""
    digest: str


class DatasetManifest(msgspec.Struct, kw_only=True):
    version: int = MANIFEST_VERSION
    id: str
    """Hash of the mode and the sorted (path, size, digest) triples: equal ids, equal data."""
    algorithm: str = HASH_ALGORITHM
    mode: ManifestMode = "full"
    sample_blocks: int = 0
    block_size: int = 0
    root: str
    """The absolute directory the paths are relative to, where it was built."""
    inputs: list[str] = []
    """The paths it was built from, relative to ``root`` (``.``: all of it): a check walks
    these for files added since."""
    files: list[ManifestEntry] = []
    total_bytes: int = 0
    created_at: float = 0.0
    seconds: float = 0.0
    """How long the build took."""


class Mismatch(msgspec.Struct, kw_only=True):
    """One file where the data differs from its manifest."""

    path: str
    kind: MismatchKind
    expected: str = ""
    actual: str = ""


class GitState(msgspec.Struct, kw_only=True):
    revision: str = ""
    branch: str = ""
    dirty: bool = False
    """Tracked files differ from ``revision`` (untracked files do not count)."""
    diff_sha256: str = ""
    """SHA-256 of ``git diff HEAD --binary`` (empty when clean): equal hashes, same edits."""
    root: str = ""
    error: str = ""
    """Why the state is unknown (no git, not a work tree, timed out)."""


class Hardware(msgspec.Struct, kw_only=True):
    cpu_model: str = ""
    cpu_count: int = 0
    memory_bytes: int = 0
    gpu_count: int = 0
    gpus: list[str] = []
    driver: str = ""
    cuda: str = ""
    nccl: str = ""
    cudnn: str = ""
    torch: str = ""


class RunRecord(msgspec.Struct, kw_only=True):
    version: int = RUN_RECORD_VERSION
    job: str = ""
    created_at: float = 0.0
    host: str = ""
    environment: dict[str, str] = {}
    """:func:`trainguard.core.identity.environment_record`: python, platform, argv, cwd..."""
    git: GitState = msgspec.field(default_factory=GitState)
    packages: dict[str, str] = {}
    """Installed distributions, name -> version."""
    hardware: Hardware = msgspec.field(default_factory=Hardware)
    env: dict[str, str] = {}
    """The variables that change a run's behaviour; secrets' values are redacted."""
    seeds: dict[str, int] = {}
    manifest_id: str = ""
    manifest_path: str = ""
    config: dict[str, Any] = {}
    """The trainer's own configuration, as given (JSON-able)."""


def encode_manifest(manifest: DatasetManifest) -> bytes:
    return msgspec.json.format(msgspec.json.encode(manifest), indent=1) + b"\n"


def decode_manifest(data: bytes) -> DatasetManifest:
    return _decode(data, DatasetManifest, "dataset manifest", MANIFEST_VERSION)


def encode_run_record(record: RunRecord) -> bytes:
    return msgspec.json.format(msgspec.json.encode(record), indent=2) + b"\n"


def decode_run_record(data: bytes) -> RunRecord:
    return _decode(data, RunRecord, "run record", RUN_RECORD_VERSION)


def _decode(data: bytes, kind: type[V], what: str, version: int) -> V:
    """``data`` as ``kind``, refused when it is not one or is of a version this reader
    does not know (a newer writer's file is refused, never half read)."""
    try:
        value = msgspec.json.decode(data, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise DecodeError(f"invalid {what}: {exc}") from None
    if value.version != version:
        raise DecodeError(f"{what} version {value.version} is not supported "
                          f"(this trainguard reads version {version})")
    return value
