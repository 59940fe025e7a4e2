"""The ``trainguard`` command: one sub-command per module in this package."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from ..errors import TrainguardError
from . import service_cmd, up

COMMANDS = (up, service_cmd)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainguard",
        description="Detect, diagnose and remediate failures of long PyTorch training jobs.",
    )
    parser.add_argument("--log-level", default=None,
                        help="DEBUG, INFO, WARNING or ERROR (default: INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS:
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = (args.log_level or "INFO").upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        parser.error(f"--log-level {args.log_level!r}: use DEBUG, INFO, WARNING or ERROR")
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.run(args))
    except TrainguardError as exc:
        print(f"trainguard {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (ConnectionError, OSError) as exc:
        print(f"trainguard {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
