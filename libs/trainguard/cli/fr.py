"""``trainguard fr DIR``: culprit ranks and groups from a directory of flight-recorder dumps.

Offline and torch-free: reads the c10d flight-recorder dumps a hung job left (NCCL's dump
on timeout, or the ones ``trainguard launch`` collects), one file per rank named after it,
and prints which ranks stopped short, per process group (:mod:`trainguard.analysis.flightrec`).

    trainguard fr /tmp/trainguard-myjob-node-a-x/            # text
    trainguard fr DIR --json                                 # the Analysis as JSON
    trainguard fr DIR --world-size 16                        # name ranks with no dump

Exit status: 0 when culprits were named, 1 when the dumps name none, 2 on errors.
"""

from __future__ import annotations

import argparse
import os
import sys

import msgspec

from trainguard.analysis import flightrec


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("fr", help="name the ranks a hang waits on, from flight-recorder dumps",
                       description="Analyse a directory of torch c10d flight-recorder dumps "
                                   "(one file per rank, named after it) and print the "
                                   "culprit ranks and the process groups they hold up.")
    p.add_argument("dir", help="directory holding the dumps")
    p.add_argument("--json", action="store_true", help="print the analysis as JSON")
    p.add_argument("--prefix", default="",
                   help="only files starting with this (default: every pickle or JSON "
                        "file whose name ends in a rank)")
    p.add_argument("--world-size", type=int, default=0,
                   help="ranks 0..N-1 should have dumped: name the missing ones")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.dir):
        print(f"trainguard fr: error: {args.dir!r} is not a directory", file=sys.stderr)
        return 2
    if args.world_size < 0:
        print("trainguard fr: error: --world-size must be 0 or more", file=sys.stderr)
        return 2
    records = flightrec.read_dir(args.dir, args.prefix)
    if not records:
        print(f"trainguard fr: error: no flight-recorder dumps in {args.dir!r} (files named "
              "<prefix><rank>; pass --prefix if yours differ)", file=sys.stderr)
        return 2
    analysis = flightrec.analyse(records, range(args.world_size))
    if args.json:
        print(msgspec.json.encode(analysis).decode())
    else:
        print(flightrec.render(analysis))
    return 0 if analysis.culprits else 1
