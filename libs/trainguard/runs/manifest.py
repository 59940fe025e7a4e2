"""Building a data set's manifest: every file's size and content hash, and the set's id.

The files are found by :func:`walk` (sorted, ``/``-separated paths relative to one root,
symlinks followed to what they name, directory cycles cut, sockets and FIFOs skipped) and
hashed on a thread pool (:mod:`.hashing`; xxhash releases the GIL, so the pool keeps every
core and the disk's queue busy). The id depends only on the mode and the (path, size,
digest) triples: two builds of the same data, in any order, on any host, agree.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from trainguard.contract.errors import TrainguardError
from trainguard.contract.runrecord import (
    DatasetManifest,
    ManifestEntry,
    ManifestMode,
    decode_manifest,
    encode_manifest,
)
from trainguard.core.files import write_atomically

from .hashing import BLOCK_SIZE, canonical_id, digest_of


class ManifestError(TrainguardError, ValueError):
    """Data that cannot be listed: a path that does not exist or a broken symlink."""


def default_workers() -> int:
    """Threads that hash at once: twice the cores (a read waiting on the disk holds no
    core), at least 4 for network file systems that serve parallel reads faster, at most 32."""
    return min(32, max(4, 2 * (os.cpu_count() or 1)))


def resolve_inputs(paths: Sequence[str | os.PathLike[str]]) -> tuple[Path, list[str]]:
    """The root the manifest's paths are relative to, and the inputs relative to it: a
    single directory is its own root; otherwise the deepest directory holding them all."""
    if not paths:
        raise ManifestError("no data paths given")
    absolute = [Path(os.path.abspath(p)) for p in paths]
    for p in absolute:
        if not p.exists():
            raise ManifestError(f"{p} does not exist" + (" (a broken symlink)"
                                                          if p.is_symlink() else ""))
    if len(absolute) == 1 and absolute[0].is_dir():
        return absolute[0], ["."]
    root = Path(os.path.commonpath([p if p.is_dir() else p.parent for p in absolute]))
    return root, sorted({p.relative_to(root).as_posix() for p in absolute})


def walk(root: Path, inputs: Iterable[str], *,
         strict: bool = True) -> Iterator[tuple[str, os.stat_result]]:
    """(relative path, stat of what it names) for each regular file under the inputs, in
    sorted order. A broken symlink is a :class:`ManifestError` when ``strict`` (a build:
    the loader would fail on it later), skipped otherwise (a check looking for new files)."""
    found: dict[str, os.stat_result] = {}
    for rel in inputs:
        start = root / rel
        try:
            st = start.stat()
        except FileNotFoundError:
            if strict:
                raise ManifestError(f"{start} does not exist") from None
            continue
        if stat.S_ISDIR(st.st_mode):
            _walk_dir(root, start, found, strict)
        elif stat.S_ISREG(st.st_mode):
            found[start.relative_to(root).as_posix()] = st
    yield from sorted(found.items())


def _walk_dir(root: Path, top: Path, found: dict[str, os.stat_result], strict: bool) -> None:
    seen: set[tuple[int, int]] = set()
    for dirpath, dirnames, filenames in os.walk(top, followlinks=True):
        st = os.stat(dirpath)
        if (st.st_dev, st.st_ino) in seen:  # a symlink back up the tree: walked already
            dirnames[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        dirnames.sort()
        for name in filenames:
            full = Path(dirpath) / name
            try:
                fst = full.stat()
            except FileNotFoundError:
                if strict:
                    raise ManifestError(f"broken symlink {full} -> {os.readlink(full)}; "
                                        "remove it or point it at the data") from None
                continue
            if stat.S_ISREG(fst.st_mode):
                found[full.relative_to(root).as_posix()] = fst


def build_manifest(paths: Sequence[str | os.PathLike[str]], *, sample: int | None = None,
                   workers: int | None = None,
                   block_size: int = BLOCK_SIZE) -> DatasetManifest:
    """The manifest of the files under ``paths``.

    ``sample``: hash that many blocks of ``block_size`` bytes per file instead of every
    byte (for data sets too large to read at each build); the manifest says so and a check
    of it samples the same blocks.
    """
    if sample is not None and sample < 1:
        raise ManifestError(f"--sample needs at least one block per file, not {sample}")
    t0 = time.perf_counter()
    root, inputs = resolve_inputs(paths)
    listed = list(walk(root, inputs))

    def one(item: tuple[str, os.stat_result]) -> ManifestEntry:
        rel, st = item
        size, digest = digest_of(root / rel, sample, block_size)
        return ManifestEntry(path=rel, size=size, mtime_ns=st.st_mtime_ns, digest=digest)

    with ThreadPoolExecutor(max_workers=workers or default_workers(),
                            thread_name_prefix="trainguard-manifest") as pool:
        entries = list(pool.map(one, listed))
    mode: ManifestMode = "sampled" if sample else "full"
    blocks, bsize = (sample, block_size) if sample else (0, 0)
    return DatasetManifest(
        id=canonical_id(mode, blocks, bsize, [(e.path, e.size, e.digest) for e in entries]),
        mode=mode, sample_blocks=blocks, block_size=bsize, root=str(root), inputs=inputs,
        files=entries, total_bytes=sum(e.size for e in entries), created_at=time.time(),
        seconds=time.perf_counter() - t0)


def write_manifest(path: str | os.PathLike[str], manifest: DatasetManifest) -> Path:
    return write_atomically(Path(path), encode_manifest(manifest))


def read_manifest(path: str | os.PathLike[str]) -> DatasetManifest:
    """The manifest in ``path``; a missing or unreadable file names the fix."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise ManifestError(f"no dataset manifest at {path}: write one with "
                            "`trainguard data manifest DATA... -o FILE`") from None
    return decode_manifest(data)
