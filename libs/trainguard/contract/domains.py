"""Failure domains: which hosts go down together (a leaf switch, a rack, a zone).

One host's loss is a host's failure; several hosts of one switch lost within a second is
the switch's. The diagnoser names the domain of hosts lost together from this table
(:mod:`trainguard.runtime.domains` reads it from a TOML or JSON file, Kubernetes node
labels or Slurm's ``topology.conf``). Data only: the reading is elsewhere.
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec

DomainLevel = Literal["switch", "rack", "zone"]
LEVELS: Final[tuple[DomainLevel, ...]] = ("switch", "rack", "zone")
"""Narrowest first: a host's narrowest domain is the one its loss is grouped by."""


class Domain(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    level: DomainLevel
    name: str

    def __str__(self) -> str:
        return f"{self.level} {self.name}"


class Topology(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """host -> its failure domains, narrowest first (a Slurm tree may list several
    switches: the leaf, then the switches above it)."""

    hosts: dict[str, list[Domain]] = {}

    def domain_of(self, host: str) -> Domain | None:
        """The narrowest domain of ``host`` (None: the topology does not name it)."""
        found = self.hosts.get(host)
        return found[0] if found else None

    def members(self, domain: Domain) -> list[str]:
        """The hosts whose narrowest domain is ``domain``."""
        return sorted(h for h, ds in self.hosts.items() if ds and ds[0] == domain)

    def __bool__(self) -> bool:
        return bool(self.hosts)
