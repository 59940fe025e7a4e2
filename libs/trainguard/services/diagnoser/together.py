"""Hosts lost together: one failure of their domain, not one failure per host.

A switch that dies takes its hosts' heartbeats with it at once; the detector raises one
``unresponsive`` anomaly per host, within a tick or two of each other. Diagnosed one by
one, that is one ``unknown`` per host, each an incident and a page. So a host's silence
is held for ``window`` seconds (:meth:`HostLosses.hold`: the others of the same failure
cross the heartbeat timeout by then, their onsets being as close as the loss was sudden),
then the silences held whose onsets lie within ``window`` of each other and whose hosts
share a failure domain (:class:`~trainguard.contract.domains.Topology`, narrowest level)
become one ``hosts_lost`` diagnosis naming the domain (:meth:`HostLosses.take`). Without a
topology, or for hosts it does not name, the hosts lost together are grouped as such and
the evidence says the domain is unknown. One host alone is diagnosed as it always was.

A ``window`` of 0 turns the grouping off (each silence at once, as before).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from trainguard.contract.domains import Domain, Topology
from trainguard.contract.schemas import Anomaly, Diagnosis, EvidenceItem

UNKNOWN_DOMAIN = "hosts lost together"
"""How a group reads when no topology names a domain its hosts share."""
FORGET_AFTER = 600.0
"""A held silence never taken (its redelivery went elsewhere) is dropped this old."""


@dataclass
class Held:
    anomaly: Anomaly
    seen: float


@dataclass(frozen=True)
class Group:
    """Silences decided together: what the diagnosis says of them."""

    members: list[Anomaly]
    domain: Domain | None
    known: int
    """Hosts the topology puts in ``domain`` (0: none named)."""

    @property
    def hosts(self) -> list[str]:
        return sorted({h for a in self.members for h in a.hosts})

    @property
    def ranks(self) -> list[int]:
        return sorted({r for a in self.members for r in a.ranks})

    @property
    def spread(self) -> float:
        onsets = [a.onset_at for a in self.members]
        return max(onsets) - min(onsets)

    @property
    def name(self) -> str:
        return str(self.domain) if self.domain is not None else ""

    def headline(self) -> str:
        """``switch sw-3: 8 hosts, 32 ranks lost within 0.8 s``."""
        return (f"{self.name or UNKNOWN_DOMAIN}: {len(self.hosts)} hosts, "
                f"{len(self.ranks)} ranks lost within {self.spread:.1f} s")

    def facts(self) -> list[EvidenceItem]:
        facts = [EvidenceItem(fact=self.headline(), source="diagnoser",
                              value=[a.id for a in self.members]),
                 EvidenceItem(fact=f"heartbeats stopped on {len(self.hosts)} hosts with no "
                                   "exit reported", source="detector", value=self.hosts)]
        if self.domain is None:
            facts.append(EvidenceItem(fact="domain unknown: no topology names a failure "
                                           "domain these hosts share", source="topology"))
        else:
            facts.append(EvidenceItem(
                fact=f"the topology puts {self.known} hosts on {self.name}; "
                     f"{len(self.hosts)} of them lost", source="topology",
                value={"level": self.domain.level, "name": self.domain.name,
                       "hosts": self.known}))
        return facts


class HostLosses:
    """Per job, the silences held for the window (pure; the clock is the caller's)."""

    def __init__(self, window: float, topology: Topology | None = None) -> None:
        self.window = window
        self.topology = topology or Topology()
        self._held: dict[str, dict[str, Held]] = collections.defaultdict(dict)

    @staticmethod
    def is_loss(a: Anomaly) -> bool:
        """One host's ranks gone silent (the detector raises one per host)."""
        return a.kind == "unresponsive" and len(a.hosts) == 1

    def domain_of(self, host: str) -> Domain | None:
        return self.topology.domain_of(host)

    def hold(self, a: Anomaly, now: float) -> float:
        """Seconds ``a`` still waits for the rest of its failure (0: decide now). A widened
        revision of a held silence replaces the one held."""
        if self.window <= 0:
            return 0.0
        held = self._held[a.job]
        for ident in [i for i, h in held.items() if now - h.seen > FORGET_AFTER]:
            del held[ident]
        was = held.get(a.id)
        if was is None:
            held[a.id] = was = Held(a, now)
        elif a.rev > was.anomaly.rev:
            was.anomaly = a
        return max(0.0, was.seen + self.window - now)

    def waiting(self, job: str, now: float) -> float:
        """Seconds until the job's last held silence is decided (0: none held): a hang
        raised meanwhile waits as long, to join the failure it follows from."""
        if self.window <= 0 or not self._held.get(job):
            return 0.0
        return max(0.0, max(h.seen for h in self._held[job].values()) + self.window - now)

    def take(self, a: Anomaly) -> Group:
        """``a`` and the silences held with it: its host's domain (or, for a host no
        topology names, the others with none), onsets within the window of its own."""
        held = self._held.get(a.job, {})
        mine = held.pop(a.id, None)
        a = mine.anomaly if mine is not None and mine.anomaly.rev > a.rev else a
        domain = self.domain_of(a.hosts[0]) if a.hosts else None
        members = [a]
        for ident, h in list(held.items()):
            b = h.anomaly
            if b.hosts and self.domain_of(b.hosts[0]) == domain \
                    and abs(b.onset_at - a.onset_at) <= self.window:
                members.append(b)
                del held[ident]
        if not held:
            self._held.pop(a.job, None)
        known = len(self.topology.members(domain)) if domain is not None else 0
        return Group(members, domain, known)

    def forget(self, a: Anomaly) -> None:
        """A silence that ended (its anomaly resolved) is no one's loss any more."""
        held = self._held.get(a.job)
        if held is not None:
            held.pop(a.id, None)

    def fits(self, a: Anomaly, d: Diagnosis) -> bool:
        """A late silence (decided after its group) of ``d``'s domain and onset window."""
        if self.window <= 0 or d.cause != "hosts_lost" or d.status != "open" \
                or not self.is_loss(a) or d.onset_at is None:
            return False
        domain = self.domain_of(a.hosts[0])
        same = (str(domain) == d.domain) if domain is not None else not d.domain
        return same and a.onset_at - d.onset_at <= self.window
