"""Remediator settings."""

from __future__ import annotations

import dataclasses

from trainguard.runtime.config import Settings


@dataclasses.dataclass(frozen=True, kw_only=True)
class RemediatorSettings(Settings):
    policy: str = ""
    """A TOML policy file overlaying the shipped defaults (``--policy FILE``)."""
    lease_ttl: float = 3.0
    """Leader lock lifetime: a standby takes over within this after the leader dies."""
    blocklist_ttl: float = 86400.0
    """How long an isolated host stays on the blocklist (s); 0: until ``trainguard
    unblock``. A host still faulty when it returns is isolated again by its next failure."""
    isolate_hook: str = ""
    """Command template run for each isolated host (:mod:`.hooks`), e.g.
    ``deploy/hooks/k8s-isolate.sh {host} {reason}``; empty: none."""
    release_hook: str = ""
    """Command template run when a host's blocklist entry ends (its TTL, or ``trainguard
    unblock``), e.g. ``deploy/hooks/k8s-release.sh {host}``; empty: none."""
    hook_timeout: float = 60.0
    """Seconds a hook may run before it is killed (its process group)."""
    blocklist_sweep: float = 5.0
    """How often the leader looks for ended blocklist entries (s)."""
