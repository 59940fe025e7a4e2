"""The ``trainguard`` command: one sub-command per module in this package.

The top layer: it may import any other, but loads each sub-command's modules only when
that sub-command runs (``trainguard launch`` and the services through their entry points),
so ``trainguard --help`` works on a base install and a missing extra is named
(:mod:`.extras`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from trainguard import __version__
from trainguard.contract.errors import ConfigError, TrainguardError
from trainguard.runtime import logs

from . import (
    checkpoints,
    credentials,
    dashboard,
    data_cmd,
    demo,
    fr,
    inject,
    observe,
    oncall,
    preflight,
    runs_cmd,
    service_cmd,
    unblock,
    up,
)
from .extras import explain

COMMANDS = (up, service_cmd, inject, oncall, checkpoints, demo, credentials, unblock, observe,
            fr, dashboard, preflight, data_cmd, runs_cmd)


def _plugin_commands() -> list[object]:
    """Sub-commands that live outside the library (``trainguard launch`` is the agent's),
    found through the ``trainguard.commands`` entry-point group so the library imports
    no service."""
    from importlib.metadata import entry_points

    modules = []
    for ep in sorted(entry_points(group="trainguard.commands"), key=lambda e: e.name):
        try:
            modules.append(ep.load())
        except Exception as exc:
            print(f"trainguard: cannot load command {ep.name!r}: {exc}", file=sys.stderr)
    return modules


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainguard",
        description="Detect, diagnose and remediate failures of long PyTorch training jobs.",
    )
    parser.add_argument("--version", action="version", version=f"trainguard {__version__}")
    _add_log_level(parser, default=None)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                parser_class=CommandParser)
    for module in (*COMMANDS, *_plugin_commands()):
        module.register(sub)  # type: ignore[attr-defined]
    return parser


def _add_log_level(p: argparse.ArgumentParser, default: object) -> None:
    p.add_argument("--log-level", default=default, type=str.upper, choices=logs.LEVELS,
                   help=f"{', '.join(logs.LEVELS)} (env {logs.LEVEL_ENV}; default INFO)")


class CommandParser(argparse.ArgumentParser):
    """A sub-command's parser: takes ``--log-level`` after the sub-command too. Its
    default is SUPPRESS, so a sub-command not given one keeps the value given before it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _add_log_level(self, default=argparse.SUPPRESS)


def _raw_command(argv: list[str]) -> argparse.Namespace | None:
    """Commands that take their arguments raw (``launch`` passes most on to torchrun,
    which argparse's REMAINDER mangles): ``trainguard NAME ...`` goes straight to them."""
    if not argv:
        return None
    for module in _plugin_commands():
        if getattr(module, "RAW_COMMAND", None) == argv[0]:
            return argparse.Namespace(command=argv[0], rest=argv[1:], log_level=None,
                                      run=module.run)  # type: ignore[attr-defined]
    return None


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = _raw_command(raw)
    parser = build_parser()
    if args is None:
        args = parser.parse_args(raw)
    try:  # level and format from the flag or TRAINGUARD_LOG_LEVEL / TRAINGUARD_LOG_FORMAT
        logs.configure(args.log_level)
    except ConfigError as exc:
        parser.error(str(exc))
    try:
        return int(args.run(args))
    except TrainguardError as exc:
        print(f"trainguard {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # an install extra's module: say which extra
        missing = explain(exc, f"trainguard {args.command}", args.command)
        if missing is None:
            raise
        print(f"trainguard {args.command}: error: {missing}", file=sys.stderr)
        return 2
    except (ConnectionError, OSError) as exc:
        print(f"trainguard {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
