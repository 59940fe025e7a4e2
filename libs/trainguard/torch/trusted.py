"""What a rank may open when it loads a checkpoint, and how it reads it without running code.

A resume point arrives over the bus, and DCP unpickles a checkpoint's ``.metadata`` and
its non-tensor values. So before DCP reads anything:

* the directory must be a step directory under this Checkpointer's own ``<root>/<job>``
  (symlinks resolved), so an answer cannot point a rank at a file it planted elsewhere;
* the coordinator's commit record (:mod:`trainguard.contract.commit_record`) must be there for a
  resume point, and match: its job and path, and the CRC32 of ``.metadata``;
* an increment (:mod:`trainguard.contract.increment`) reads its base too: the base must lie
  beside it, be committed as the checkpoint the increment's record names, and every file
  of both must match its record's size and CRC32 before DCP reads a byte;
* ``.metadata`` is first read by an unpickler that admits only DCP's metadata classes,
  torch sizes and dtypes, and every non-tensor value is first read with
  ``torch.load(weights_only=True)``: a crafted pickle raises instead of executing.

trainguard's own per-rank state avoids pickle altogether: Python's and numpy's RNG states
are msgspec-encoded, ``extra`` must be tensors and plain containers.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import random
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec
import torch

if TYPE_CHECKING:  # DCP costs ~0.7 s to import: only when a checkpoint is read
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import LoadPlanner
    from torch.distributed.checkpoint.storage import StorageReader

from trainguard.contract.checksum import METADATA_FILE, crc32_of
from trainguard.contract.commit_record import COMMIT_FILE, CommitRecord, decode_commit
from trainguard.contract.errors import TrainguardError
from trainguard.contract.increment import INCREMENT_FILE, Increment, decode_increment

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED: frozenset[tuple[str, str]] = frozenset({
    *((_METADATA_MODULE, name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
})


class CheckpointRefused(TrainguardError):
    """A checkpoint this rank will not open: outside its root, uncommitted, or crafted."""


def confine(path: str | os.PathLike[str], root: str | os.PathLike[str], job: str) -> Path:
    """``path`` resolved, if it lies under ``<root>/<job>``; else :class:`CheckpointRefused`."""
    base = (Path(root) / job).resolve()
    resolved = Path(path).resolve()
    if resolved == base or not resolved.is_relative_to(base):
        raise CheckpointRefused(f"checkpoint {path} is not under {base}: refusing to open it "
                                "(a resume point names this job's own checkpoints only)")
    return resolved


def check_commit(path: Path, job: str, *, required: bool, metadata: bytes
                 ) -> CommitRecord | None:
    """Match ``path`` and its ``metadata`` bytes against the coordinator's commit record,
    and return the record. ``required`` for resume points (they come over the bus); a path
    the user's own code names may have none (then None)."""
    record_path = path / COMMIT_FILE
    try:
        record = decode_commit(record_path.read_bytes())
    except FileNotFoundError:
        if required:
            raise CheckpointRefused(f"{path} has no commit record ({COMMIT_FILE}): the "
                                    "coordinator never committed it") from None
        return None
    except (OSError, TrainguardError) as exc:
        raise CheckpointRefused(f"unreadable commit record {record_path}: {exc}") from None
    if record.job != job or Path(record.path).resolve() != path:
        raise CheckpointRefused(f"commit record {record_path} is for {record.job} at "
                                f"{record.path}, not {job} at {path}")
    _match(path / METADATA_FILE, metadata, record)
    return record


def _match(path: Path, data: bytes, record: CommitRecord) -> None:
    """``data`` (read from ``path``) has the CRC32 the commit record gives it, if any."""
    want = record.files.get(path.name)
    if want is not None and want.crc32 is not None:
        got = zlib.crc32(data)
        if got != want.crc32:
            raise CheckpointRefused(f"{path} has CRC32 {got:#x}, the commit record says "
                                    f"{want.crc32:#x}: the file changed")


class Opened(NamedTuple):
    """A checkpoint directory as a load may read it: checked, not yet read by DCP."""

    path: Path
    metadata: Metadata
    record: CommitRecord | None
    """The coordinator's commit record (None: a path the user named, never committed)."""
    increment: Increment | None
    """What it left to its base (None: a full checkpoint)."""


def open_checkpoint(path: Path, job: str, *, required: bool = False) -> Opened:
    """:func:`read_metadata` of ``path``, its commit record and its ``INCREMENT`` (checked
    against the record: an increment whose record lists the file must have it)."""
    metadata, record = _read_metadata(path, job, required=required)
    increment = None
    try:
        data = (path / INCREMENT_FILE).read_bytes()
    except FileNotFoundError:
        if record is not None and INCREMENT_FILE in record.files:
            raise CheckpointRefused(f"{path / INCREMENT_FILE} is missing: the commit record "
                                    "lists it") from None
        data = None
    except OSError as exc:
        raise CheckpointRefused(f"unreadable {path / INCREMENT_FILE}: {exc}") from None
    if data is not None:
        if record is not None:
            _match(path / INCREMENT_FILE, data, record)
        try:
            increment = decode_increment(data)
        except TrainguardError as exc:
            raise CheckpointRefused(f"{path / INCREMENT_FILE}: {exc}") from None
    return Opened(path, metadata, record, increment)


def open_chain(path: Path, root: str | os.PathLike[str], job: str, *, required: bool = False
               ) -> list[Opened]:
    """The checkpoints a load of ``path`` reads, newest first: itself, and its base where
    it is an increment. The base lies beside it under the same root and must be committed
    wherever the increment is, as the same checkpoint its commit record names."""
    head = open_checkpoint(path, job, required=required)
    if head.increment is None:
        return [head]
    base_path = confine(path.parent / f"step-{head.increment.base}", root, job)
    try:
        base = open_checkpoint(base_path, job, required=required or head.record is not None)
    except CheckpointRefused as exc:
        raise CheckpointRefused(f"the base of increment {path.name} does not open: "
                                f"{exc}") from None
    if base.increment is not None:
        raise CheckpointRefused(f"the base {base_path.name} of {path.name} is itself an "
                                "increment: a chain is one full checkpoint and one increment")
    want = head.record.base_id if head.record is not None else ""
    if want and base.record is not None and base.record.checkpoint_id != want:
        raise CheckpointRefused(f"{base_path.name} holds checkpoint {base.record.checkpoint_id}, "
                                f"not the base {want} that {path.name} was committed on")
    return [head, base]


def verify_files(link: Opened, share: int = 0, shares: int = 1) -> None:
    """Every ``shares``-th file its commit record lists, from the ``share``-th, has the size
    and CRC32 the record gives (a missing or garbled file of a chain is refused before DCP
    reads a byte of it); nothing to check without a record."""
    if link.record is None:
        return
    for i, (name, want) in enumerate(sorted(link.record.files.items())):
        if i % shares != share or "/" in name or name in ("", ".", ".."):
            continue
        path = link.path / name
        try:
            size = path.stat().st_size
            if size != want.bytes:
                raise CheckpointRefused(f"{path} has {size} bytes, the commit record says "
                                        f"{want.bytes}")
            if want.crc32 is not None and (got := crc32_of(path)) != want.crc32:
                raise CheckpointRefused(f"{path} has CRC32 {got:#x}, the commit record says "
                                        f"{want.crc32:#x}: the file changed")
        except OSError as exc:
            raise CheckpointRefused(f"{path} is unreadable: {exc.strerror or exc}") from None


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # Exact pairs only: a dotted name ("os.system") would walk the module's imports.
        if "." not in name and ((module, name) in _ALLOWED or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))):
            return super().find_class(module, name)
        raise CheckpointRefused(f"checkpoint metadata references {module}.{name}, which "
                                "DCP metadata never holds: refusing to load it")


def read_metadata(path: Path, job: str | None = None, *, required: bool = False) -> Metadata:
    """DCP's ``.metadata`` of ``path``, read once: checked against the commit record (where
    ``job`` is given) and unpickled without admitting arbitrary classes. Hand the result to
    DCP through :func:`reader_for`, so it never reads the file again itself."""
    return _read_metadata(path, job, required=required)[0]


def _read_metadata(path: Path, job: str | None, *, required: bool
                   ) -> tuple[Metadata, CommitRecord | None]:
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        data = (path / METADATA_FILE).read_bytes()
    except OSError as exc:
        raise CheckpointRefused(f"unreadable checkpoint metadata in {path}: {exc}") from None
    record = check_commit(path, job, required=required, metadata=data) \
        if job is not None else None
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointRefused:
        raise
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as exc:
        raise CheckpointRefused(f"unreadable checkpoint metadata in {path}: {exc}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointRefused(f"{path / METADATA_FILE} holds no DCP metadata")
    return metadata, record


def reader_for(path: Path, metadata: Metadata) -> StorageReader:
    """DCP's file-system reader of ``path`` that answers with ``metadata`` (read and checked
    by :func:`read_metadata`) instead of unpickling ``.metadata`` again."""
    return _reader_class()(str(path), metadata)


@functools.cache
def _reader_class() -> Callable[[str, Metadata], StorageReader]:
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class CheckedReader(FileSystemReader):
        def __init__(self, path: str, metadata: Metadata) -> None:
            super().__init__(path)
            self.checked_metadata = metadata

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            metadata = self.checked_metadata
            meta = metadata.storage_meta
            if meta is None:
                meta = metadata.storage_meta = StorageMeta()
            meta.load_id = self.load_id  # as FileSystemReader.read_metadata does
            return metadata

    return CheckedReader


def safe_load_planner() -> LoadPlanner:
    """DCP's default planner, except that a non-tensor value must load with
    ``weights_only=True`` (tensors, numbers, strings, plain containers) before it is set."""
    return _safe_planner_class()()


@functools.cache
def _safe_planner_class() -> type[LoadPlanner]:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import ReadItem

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            try:
                torch.load(value, weights_only=True)
            except Exception as exc:
                raise CheckpointRefused(f"checkpoint value {read_item.dest_index.fqn} is "
                                        f"not plain data: {exc}") from None
            value.seek(0)
            super().load_bytes(read_item, value)

    return SafeLoadPlanner


def encode_py_rng() -> bytes:
    """Python's and numpy's RNG states as msgspec JSON (no pickle)."""
    np_state: list[Any] | None = None
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        np_state = [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    version, internal, gauss = random.getstate()
    return msgspec.json.encode({"py": [version, list(internal), gauss], "np": np_state})


def restore_py_rng(blob: bytes) -> bool:
    """Set what :func:`encode_py_rng` saved; False (streams left as they are) for a blob of
    an older trainguard, which pickled it: never unpickled. :class:`CheckpointRefused` if
    malformed."""
    if blob[:1] == b"\x80":  # a pickle protocol header, not JSON
        return False
    try:
        state = msgspec.json.decode(blob)
        version, internal, gauss = state["py"]
        random.setstate((int(version), tuple(int(x) for x in internal), gauss))
        np_state = state.get("np")
    except (msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointRefused(f"malformed RNG state in checkpoint: {exc}") from None
    if np_state is not None:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np_state
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    return True


def to_blob(obj: Any) -> bytes:
    """``extra`` as bytes: tensors and plain containers only (loaded with weights_only)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_blob(blob: bytes) -> Any:
    try:
        return torch.load(io.BytesIO(blob), weights_only=True)
    except Exception as exc:
        raise CheckpointRefused(f"checkpoint extra state is not plain data: {exc}") from None
