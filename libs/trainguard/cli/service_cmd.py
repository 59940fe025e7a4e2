"""``trainguard service NAME``: one service in the foreground (one process or pod each)."""

from __future__ import annotations

import argparse
import asyncio

from trainguard.contract.errors import ConfigError
from trainguard.runtime import registry, telemetry

from . import extras
from .common import add_connection_flags, settings_from


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("service", help="run one service (for real deployments)",
                       description="Run one trainguard service until SIGTERM/SIGINT.")
    p.add_argument("name", help="service name: " + (", ".join(sorted(registry.available()))
                                                   or "none installed"))
    add_connection_flags(p)
    p.add_argument("--health-port", type=int, default=None,
                   help="port for /livez, /readyz, /metrics (env TRAINGUARD_HEALTH_PORT; "
                        "default: TRAINGUARD_BASE_PORT + the service's offset, else any free "
                        "port); bind address: TRAINGUARD_HEALTH_HOST (0.0.0.0 in a pod)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    extras.require("services", "trainguard service")
    from trainguard.runtime.service import run_service

    cls = registry.load(args.name)
    settings = settings_from(args, cls.settings_type, health_port=args.health_port)
    if (why := cls.unconfigured(settings)) is not None:
        raise ConfigError(f"service {cls.name}: {why}")
    telemetry.setup_tracing(f"trainguard-{cls.name}", settings.otel_exporter)
    return asyncio.run(run_service(cls(settings)))
