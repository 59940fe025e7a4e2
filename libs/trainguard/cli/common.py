"""Flags shared by sub-commands, turned into a typed :class:`Settings`."""

from __future__ import annotations

import argparse
from typing import Any

from trainguard.runtime.config import Settings, load_settings


def tcp_port(text: str) -> int:
    """argparse type for a TCP port; a bad one is a usage error (exit 2) saying why."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"{port}: use a TCP port between 1 and 65535")
    return port


def add_connection_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nats", metavar="URL", help="NATS URL (env TRAINGUARD_NATS_URL; "
                   "default nats://127.0.0.1:4222)")
    p.add_argument("--redis", metavar="URL", help="Redis URL (env TRAINGUARD_REDIS_URL; "
                   "default redis://127.0.0.1:6379/0)")
    p.add_argument("--prefix", help="subject and key prefix (env TRAINGUARD_PREFIX; default tg)")
    p.add_argument("--credentials", metavar="FILE",
                   help="this role's credentials file (env TRAINGUARD_CREDENTIALS; "
                        "`trainguard up` writes them under <data-dir>/creds)")


def settings_from(args: argparse.Namespace, cls: type[Settings] = Settings,
                  **extra: Any) -> Settings:
    return load_settings(cls, overrides={
        "nats_url": getattr(args, "nats", None),
        "redis_url": getattr(args, "redis", None),
        "prefix": getattr(args, "prefix", None),
        "credentials": getattr(args, "credentials", None),
        **extra,
    })
