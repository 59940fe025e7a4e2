"""Remediator settings."""

from __future__ import annotations

import dataclasses

from trainguard.config import Settings


@dataclasses.dataclass(frozen=True, kw_only=True)
class RemediatorSettings(Settings):
    policy: str = ""
    """A TOML policy file overlaying the shipped defaults (``--policy FILE``)."""
    lease_ttl: float = 3.0
    """Leader lock lifetime: a standby takes over within this after the leader dies."""
