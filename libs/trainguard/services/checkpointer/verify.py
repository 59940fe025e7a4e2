"""Does a checkpoint on disk match what its ranks reported?

``size`` mode checks that every reported file exists with the reported size, which catches
a truncated or missing shard for the price of a ``stat``. ``full`` mode also re-reads each
file and compares its CRC32 with the rank's (computed as :mod:`trainguard.contract.checksum` says,
the same code the ranks ran), which catches corruption, for the price of reading the whole
checkpoint. Runs in a worker thread (blocking file I/O).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from trainguard.contract.checksum import METADATA_FILE, crc32_of
from trainguard.contract.schemas import CheckpointReport


@dataclass(frozen=True)
class Integrity:
    ok: bool
    reason: str = ""
    missing_ranks: list[int] = field(default_factory=list)
    """Ranks of the world with no report."""
    bad_ranks: list[int] = field(default_factory=list)
    """Ranks whose report failed or whose files do not match."""
    bytes: int = 0


def _safe_name(name: str) -> bool:
    """A file name inside the checkpoint directory, never a path out of it."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name \
        and os.sep not in name


def verify_checkpoint(reports: Mapping[int, CheckpointReport], world_size: int, *,
                      mode: str = "size", require_metadata: bool = True) -> Integrity:
    """Judge one checkpoint from its reports (by rank) and the files on disk.
    ``require_metadata`` asks DCP's ``.metadata`` of checkpoints the Checkpointer wrote
    (format ``dcp``), not of a framework's own."""
    missing = [r for r in range(world_size) if r not in reports]
    failed = {r: rep.error or "failed without a reason" for r, rep in reports.items()
              if not rep.ok}
    if failed:
        detail = "; ".join(f"rank {r}: {why}" for r, why in sorted(failed.items()))
        tail = f"; no report from ranks {missing}" if missing else ""
        return Integrity(False, f"save failed on {detail}{tail}", missing, sorted(failed))
    if missing:
        return Integrity(False, f"no report from ranks {missing}", missing)
    paths = {rep.path for rep in reports.values()}
    if len(paths) != 1:
        return Integrity(False, f"ranks reported different paths: {sorted(paths)}", [],
                       sorted(reports))
    root = Path(paths.pop())
    problems: list[str] = []
    bad: set[int] = set()
    names: set[str] = set()
    total = 0
    for rank, rep in sorted(reports.items()):
        for name, digest in sorted(rep.files.items()):
            names.add(name)
            if not _safe_name(name):
                problems.append(f"rank {rank}: file name {name!r} leaves the checkpoint")
                bad.add(rank)
                continue
            path = root / name
            try:
                size = path.stat().st_size
            except OSError as exc:
                problems.append(f"rank {rank}: {name} is missing ({exc.strerror or exc})")
                bad.add(rank)
                continue
            total += size
            if size != digest.bytes:
                problems.append(f"rank {rank}: {name} has {size} bytes, reported "
                                f"{digest.bytes}")
                bad.add(rank)
                continue
            if mode == "full":
                if digest.crc32 is None:
                    problems.append(f"rank {rank}: {name} has no reported checksum")
                    bad.add(rank)
                    continue
                try:
                    crc = crc32_of(path)
                except OSError as exc:
                    problems.append(f"rank {rank}: {name} unreadable ({exc})")
                    bad.add(rank)
                    continue
                if crc != digest.crc32:
                    problems.append(f"rank {rank}: {name} checksum {crc:#010x} differs from "
                                    f"reported {digest.crc32:#010x}")
                    bad.add(rank)
    # DCP's .metadata is what a DCP load opens first; a framework's own format has its own.
    dcp = any(rep.format == "dcp" for rep in reports.values())
    if require_metadata and dcp and METADATA_FILE not in names:
        problems.append(f"no rank reported {METADATA_FILE} (the checkpoint cannot be loaded)")
    if problems:
        shown = "; ".join(problems[:10])
        more = f" (+{len(problems) - 10} more)" if len(problems) > 10 else ""
        return Integrity(False, f"files do not verify: {shown}{more}", [], sorted(bad), total)
    return Integrity(True, "", [], [], total)
