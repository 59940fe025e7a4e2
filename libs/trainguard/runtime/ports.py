"""Fixed health ports: one base port and a documented offset per service.

Prometheus scrapes a fixed address, so every service's ``/livez``, ``/readyz`` and
``/metrics`` listen on ``base_port + offset`` (``trainguard up --base-port``,
``TRAINGUARD_BASE_PORT``) unless ``health_port`` names one outright. With no base port and
no health port a service takes any free port and logs it (tests, one-off runs).

The table is the documentation: README "Health and metrics" and ``deploy/prometheus``
repeat it, and a unit test keeps them in step. A plugin service missing from the table
gets ``base + PLUGIN_OFFSET + i``, ``i`` its index among the installed plugin names in
sorted order, so its port too is the same on every start.
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib.metadata import entry_points
from typing import Final

from trainguard.contract.errors import ConfigError

DEFAULT_BASE_PORT: Final = 9460
"""``trainguard up``'s default: 9461-9466 are the services below."""

OFFSETS: Final[dict[str, int]] = {
    "detector": 1,
    "diagnoser": 2,
    "remediator": 3,
    "checkpointer": 4,
    "bridge": 5,
    "dashboard": 6,
}
"""Health port of each shipped service, as an offset from the base port (``base + 0`` is
left free)."""
PLUGIN_OFFSET: Final = 10


def health_port(service: str, base: int, installed: Iterable[str] | None = None) -> int:
    """The health port of ``service`` under ``base``; 0 (any free port) when ``base`` is 0.

    ``installed``: every installed service name (default: the ``trainguard.services``
    entry points), needed only to place a plugin service.
    """
    if base == 0:
        return 0
    if base < 0:
        raise ConfigError(f"base_port={base}: use a TCP port (0: no fixed ports)")
    if service in OFFSETS:
        port = base + OFFSETS[service]
    else:
        names = installed if installed is not None else \
            (ep.name for ep in entry_points(group="trainguard.services"))
        plugins = sorted({*names, service} - OFFSETS.keys())
        port = base + PLUGIN_OFFSET + plugins.index(service)
    if not 0 < port < 65536:
        raise ConfigError(f"base_port={base}: the health port of {service} would be {port}; "
                          f"use a base port below {65535 - PLUGIN_OFFSET - len(OFFSETS)}")
    return port
