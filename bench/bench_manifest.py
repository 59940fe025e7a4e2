"""Dataset manifest throughput: `trainguard data manifest` over 10 GB of files (target 60 s).

Writes 40 files of 256 MB (reused when present with the right sizes; deleted at the end
unless --keep) and builds their manifest: cold (each file's pages dropped from the page
cache first with ``posix_fadvise(DONTNEED)`` after an fsync, which needs no privilege for
clean pages), then warm (from the page cache) with 1, 2 and the default number of threads,
and sampled (16 blocks of 1 MiB per file, cold). The baseline, in the same run over the
same files: ``hashlib.sha256`` on one thread, cold and warm. With under 25 GB free on the
disk it uses a smaller set and says so.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from trainguard.runs.manifest import build_manifest, default_workers
from trainguard.runs.verify import verify

GB = 1e9
MB = 1024 * 1024
FILE_SIZE = 256 * MB
PATTERN = 64 * MB


def make_files(root: Path, count: int) -> float:
    """``count`` files of FILE_SIZE bytes (kept when already there); seconds spent writing."""
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    block = rng.randbytes(PATTERN)
    t0 = time.perf_counter()
    for i in range(count):
        path = root / f"shard-{i:03d}.bin"
        if path.exists() and path.stat().st_size == FILE_SIZE:
            continue
        with open(path, "wb") as fh:
            for j in range(FILE_SIZE // PATTERN):
                fh.write(f"{i}:{j}:".encode().ljust(64, b"\0"))  # no two chunks alike
                fh.write(block[64:])
            fh.flush()
            os.fsync(fh.fileno())
    return time.perf_counter() - t0


def drop_cache(root: Path) -> None:
    """Evict the files' (clean) pages, so the next read comes from the disk."""
    for path in root.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sha256_all(root: Path) -> None:
    buf = bytearray(8 * MB)
    view = memoryview(buf)
    for path in sorted(root.iterdir()):
        h = hashlib.sha256()
        with open(path, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                h.update(view[:n])


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write results as JSON here")
    p.add_argument("--dir", default=str(Path(tempfile.gettempdir()) / "trainguard-bench-data"),
                   help="where the files go (local disk)")
    p.add_argument("--files", type=int, default=40, help="256 MB files (default 40: 10.7 GB)")
    p.add_argument("--keep", action="store_true", help="leave the files for the next run")
    args = p.parse_args()
    root = Path(args.dir)
    root.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root.parent).free
    count = args.files
    note = ""
    if free < 25 * GB and not root.exists():
        count = max(1, min(count, int(free / 4 / FILE_SIZE)))
        note = f"only {free / GB:.1f} GB free: {count} files instead of {args.files}"
        print(note, file=sys.stderr)
    results: dict[str, object] = {"files": count, "bytes": count * FILE_SIZE, "note": note,
                                  "default_workers": default_workers(), "cpus": os.cpu_count()}
    try:
        wrote = make_files(root, count)
        size = count * FILE_SIZE / GB
        rows: list[tuple[str, float]] = []
        drop_cache(root)
        cold = build_manifest([root])
        rows.append(("xxh3_128 manifest, cold, default threads", cold.seconds))
        for workers in (1, 2, default_workers()):
            warm = build_manifest([root], workers=workers)
            assert warm.id == cold.id
            rows.append((f"xxh3_128 manifest, warm, {workers} thread(s)", warm.seconds))
        rows.append(("quick verify (sizes, names)", timed(lambda: verify(cold))))
        rows.append(("sha256 baseline, warm, 1 thread", timed(lambda: sha256_all(root))))
        drop_cache(root)
        rows.append(("sha256 baseline, cold, 1 thread", timed(lambda: sha256_all(root))))
        drop_cache(root)
        sampled = build_manifest([root], sample=16)
        rows.append(("sampled manifest (16 x 1 MiB/file), cold", sampled.seconds))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(f"{count} files, {size:.2f} GB in {root} (written in {wrote:.1f}s"
          f"{'' if wrote > 0.1 else ', reused'}); {os.cpu_count()} CPUs")
    print(f"{'':44} {'seconds':>8} {'GB/s':>7}")
    for name, seconds in rows:
        print(f"{name:44} {seconds:8.2f} {size / seconds:7.2f}")
        results[name] = {"seconds": round(seconds, 3), "gb_per_s": round(size / seconds, 3)}
    target = rows[0][1]
    print(f"target: 10 GB in <= 60 s; cold build {target:.1f}s for {size:.1f} GB "
          f"({'met' if target * 10 / size <= 60 else 'MISSED'})")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
