"""Service discovery through the ``trainguard.services`` entry-point group.

Each service package registers ``NAME = "trainguard.services.NAME:Service"`` (a
:class:`trainguard.runtime.service.Service` subclass), so the library finds services by name
without importing any of them until asked.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING

from trainguard.contract.errors import ConfigError

if TYPE_CHECKING:
    from .service import Service

GROUP = "trainguard.services"


def available() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def load(name: str) -> type[Service]:
    """The Service class registered as ``name``; :class:`ConfigError` if there is none."""
    eps = available()
    if name not in eps:
        known = ", ".join(sorted(eps)) or "none installed"
        raise ConfigError(f"unknown service {name!r}; available services: {known}")
    from .service import Service  # the services' stack, loaded only to run one

    cls = eps[name].load()
    if not (isinstance(cls, type) and issubclass(cls, Service)):
        raise ConfigError(f"entry point {name!r} does not name a trainguard Service class")
    return cls
