"""Checking data against its manifest, and refusing (or alerting on) a difference.

Two depths. ``quick``: every file of the manifest exists with its size, and no file was
added under the manifest's inputs; for a sampled manifest it also re-hashes the sampled
blocks (a bounded cost, ``sample_blocks`` x ``block_size`` per file, that catches most
rewrites). ``full``: every file re-hashed as the manifest was built (a sampled manifest can
only be re-sampled, so ``full`` equals ``quick`` there). Modification times are not
compared: a copy to a new host changes them and not the data.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

from trainguard.contract.errors import TrainguardError
from trainguard.contract.runrecord import DATA_POLICIES, DatasetManifest, ManifestEntry, Mismatch

from .hashing import digest_of
from .manifest import default_workers, read_manifest, walk

log = logging.getLogger(__name__)

CheckMode = Literal["quick", "full"]
SHOWN = 5
"""Differing files an error message names before it says how many more there are."""


class DataRefused(TrainguardError):
    """A job will not train on this data: its files differ from the manifest it declared
    (on this rank: :class:`DataMismatch`; on a peer: this, naming the peer)."""


class DataMismatch(DataRefused):
    """The data differs from the manifest a job declared: names the first differing files
    and the two ways out (restore the files, or declare a new manifest)."""

    def __init__(self, mismatches: Sequence[Mismatch], manifest: DatasetManifest,
                 root: str | os.PathLike[str]) -> None:
        self.mismatches = list(mismatches)
        self.manifest_id = manifest.id
        self.root = str(root)
        super().__init__(describe(self.mismatches, manifest, root))


def describe(mismatches: Sequence[Mismatch], manifest: DatasetManifest,
             root: str | os.PathLike[str]) -> str:
    shown = "; ".join(_one(m) for m in mismatches[:SHOWN])
    more = f"; and {len(mismatches) - SHOWN} more" if len(mismatches) > SHOWN else ""
    return (f"the data under {root} differs from manifest {manifest.id} in "
            f"{len(mismatches)} file(s): {shown}{more}. Restore those files, or, if the data "
            f"changed on purpose, write a new manifest (`trainguard data manifest {root} -o "
            f"FILE`) and declare it; `trainguard data manifest --verify FILE {root}` lists "
            "every difference")


def _one(m: Mismatch) -> str:
    if m.kind == "size":
        return f"{m.path} size {m.expected} -> {m.actual} bytes"
    if m.kind in ("content", "unreadable"):
        return f"{m.path} {m.kind}" + (f" ({m.actual})" if m.kind == "unreadable" else "")
    return f"{m.path} {m.kind}"


def verify(manifest: DatasetManifest, root: str | os.PathLike[str] | None = None, *,
           mode: CheckMode = "quick", workers: int | None = None) -> list[Mismatch]:
    """The files under ``root`` (default: where the manifest was built) that differ from
    ``manifest``, sorted by path; ``[]`` when the data matches."""
    if mode not in ("quick", "full"):
        raise ValueError(f"check mode {mode!r}: expected 'quick' or 'full'")
    base = Path(manifest.root if root is None else root)
    expected = {e.path: e for e in manifest.files}
    present = dict(walk(base, manifest.inputs or ["."], strict=False))
    out = [Mismatch(path=p, kind="missing") for p in expected if p not in present]
    out += [Mismatch(path=p, kind="added", actual=str(st.st_size))
            for p, st in present.items() if p not in expected]
    same_size = []
    for path, entry in expected.items():
        st = present.get(path)
        if st is None:
            continue
        if st.st_size != entry.size:
            out.append(Mismatch(path=path, kind="size", expected=str(entry.size),
                                actual=str(st.st_size)))
        else:
            same_size.append(entry)
    if mode == "full" or manifest.mode == "sampled":
        out += _rehash(base, manifest, same_size, workers)
    return sorted(out, key=lambda m: (m.path, m.kind))


def _rehash(base: Path, manifest: DatasetManifest, entries: list[ManifestEntry],
            workers: int | None) -> list[Mismatch]:
    sample = manifest.sample_blocks if manifest.mode == "sampled" else None

    def one(entry: ManifestEntry) -> Mismatch | None:
        try:
            _, digest = digest_of(base / entry.path, sample, manifest.block_size or 1)
        except OSError as exc:
            return Mismatch(path=entry.path, kind="unreadable", actual=str(exc))
        if digest != entry.digest:
            return Mismatch(path=entry.path, kind="content", expected=entry.digest,
                            actual=digest)
        return None

    with ThreadPoolExecutor(max_workers=workers or default_workers(),
                            thread_name_prefix="trainguard-verify") as pool:
        return [m for m in pool.map(one, entries) if m is not None]


def check_data(manifest: DatasetManifest | str | os.PathLike[str],
               root: str | os.PathLike[str] | None = None, *, policy: str = "refuse",
               mode: CheckMode = "quick") -> list[Mismatch]:
    """What a job calls before it trains (at start and at every resume): with ``policy``
    ``refuse``, a difference raises :class:`DataMismatch`; with ``alert`` it is logged and
    returned, for the caller to alert on, and the job goes on."""
    if policy not in DATA_POLICIES:
        raise ValueError(f"data policy {policy!r}: expected one of {sorted(DATA_POLICIES)}")
    loaded = manifest if isinstance(manifest, DatasetManifest) else read_manifest(manifest)
    base = loaded.root if root is None else root
    mismatches = verify(loaded, base, mode=mode)
    if mismatches and policy == "refuse":
        raise DataMismatch(mismatches, loaded, base)
    if mismatches:
        log.warning("%s", describe(mismatches, loaded, base))
    return mismatches
