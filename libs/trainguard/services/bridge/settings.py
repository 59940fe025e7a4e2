"""Bridge settings: where notifications go (the routes are in the policy file)."""

from __future__ import annotations

import dataclasses

from trainguard.runtime.config import Settings


@dataclasses.dataclass(frozen=True, kw_only=True)
class BridgeSettings(Settings):
    policy: str = ""
    """The remediation policy file (``TRAINGUARD_POLICY``, shared with the remediator): its
    ``[notify]`` section holds routes, grouping and rate limits."""
    alertmanager_url: str = ""
    """Alertmanager's base URL (``http://host:9093``); alerts go to ``/api/v2/alerts``."""
    webhook_url: str = ""
    """A receiver of CloudEvents 1.0 over HTTP, binary mode (``ce-*`` headers)."""
    slack_webhook_url: str = ""
    """A Slack incoming-webhook URL (a secret: keep it in the environment)."""
    dashboard_url: str = ""
    """Base of the links notifications carry (``<url>?job=J&incident=ID``); empty: none."""
    http_timeout: float = 5.0
    """Bound on one HTTP request to a sink."""
