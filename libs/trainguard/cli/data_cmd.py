"""``trainguard data manifest``: a data set's manifest, and the check of data against one.

    trainguard data manifest /data/tokens -o tokens.manifest.json     # every byte hashed
    trainguard data manifest /data/tokens --sample 16 -o m.json        # 16 blocks per file
    trainguard data manifest --verify m.json [/mnt/copy/tokens] [--full]

``--verify`` exits 0 when the data matches, 1 with the differing files listed, 2 on errors.
"""

from __future__ import annotations

import argparse
import sys
import time


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("data", help="dataset manifests: write one, check data against one",
                       description="Dataset manifests: the files of a data set with their "
                                   "sizes and XXH3-128 content hashes, and its id.")
    commands = p.add_subparsers(dest="data_command", metavar="COMMAND", required=True)
    m = commands.add_parser("manifest", help="write a data set's manifest or check against one",
                            description="Write the manifest of the files under PATH... "
                                        "(to stdout or -o FILE), or with --verify check a "
                                        "data tree against a manifest (exit 1: it differs).")
    m.add_argument("paths", nargs="*", metavar="PATH",
                   help="data files or directories (with --verify: the data's root, "
                        "default where the manifest was built)")
    m.add_argument("-o", "--output", metavar="FILE", help="write the manifest here (atomically)")
    m.add_argument("--sample", type=int, metavar="N",
                   help="hash N 1 MiB blocks per file (and its size) instead of every byte")
    m.add_argument("--workers", type=int, metavar="N", help="files hashed at once")
    m.add_argument("--verify", metavar="MANIFEST", help="check the data against MANIFEST")
    m.add_argument("--full", action="store_true",
                   help="with --verify: re-hash every file (default: sizes, names and a "
                        "sampled manifest's blocks)")
    m.set_defaults(run=run_manifest)


def run_manifest(args: argparse.Namespace) -> int:
    from trainguard.contract.errors import ConfigError

    if args.verify:
        return _verify(args)
    if args.full:
        raise ConfigError("--full goes with --verify MANIFEST")
    if not args.paths:
        raise ConfigError("name the data: trainguard data manifest PATH... [-o FILE]")
    from trainguard.contract.runrecord import encode_manifest
    from trainguard.runs.manifest import build_manifest, write_manifest

    manifest = build_manifest(args.paths, sample=args.sample, workers=args.workers)
    summary = (f"manifest {manifest.id}: {len(manifest.files)} files, "
               f"{manifest.total_bytes / 1e9:.3f} GB, {manifest.mode}"
               f"{f' ({manifest.sample_blocks} blocks/file)' if manifest.sample_blocks else ''}"
               f", {manifest.seconds:.1f}s "
               f"({manifest.total_bytes / 1e9 / max(manifest.seconds, 1e-9):.2f} GB/s)")
    if args.output:
        write_manifest(args.output, manifest)
        print(f"{summary}; written to {args.output}")
    else:
        sys.stdout.buffer.write(encode_manifest(manifest))
        sys.stdout.flush()
        print(summary, file=sys.stderr)
    return 0


def _verify(args: argparse.Namespace) -> int:
    from trainguard.contract.errors import ConfigError
    from trainguard.runs.manifest import read_manifest
    from trainguard.runs.verify import verify

    if len(args.paths) > 1 or args.output or args.sample:
        raise ConfigError("--verify MANIFEST takes at most one PATH (the data's root) and "
                          "neither -o nor --sample")
    manifest = read_manifest(args.verify)
    root = args.paths[0] if args.paths else manifest.root
    t0 = time.perf_counter()
    mismatches = verify(manifest, root, mode="full" if args.full else "quick",
                        workers=args.workers)
    took = time.perf_counter() - t0
    for m in mismatches:
        detail = (f"  ({m.actual} bytes)" if m.kind == "added" else f"  ({m.actual})"
                  if m.kind == "unreadable" else f"  ({m.expected} -> {m.actual})"
                  if m.expected else "")
        print(f"{m.kind:<10} {m.path}{detail}")
    depth = "full" if args.full else "quick"
    if mismatches:
        print(f"{root} differs from manifest {manifest.id} in {len(mismatches)} file(s) "
              f"({depth} check, {took:.1f}s)", file=sys.stderr)
        return 1
    print(f"{root} matches manifest {manifest.id}: {len(manifest.files)} files "
          f"({depth} check, {took:.1f}s)")
    return 0
