"""What ``trainguard launch`` exits with, for schedulers (docs/design.md, "Exit codes for
schedulers"): a Kubernetes ``podFailurePolicy`` and a Slurm requeue act on these."""

from __future__ import annotations

import signal
from typing import Final

EXIT_ISOLATED: Final = 200
"""This host left the job (isolated, or blocklisted at launch). Above the signal range
(128 + 1..64) so no signal death reads as isolation, and in Kubeflow's retryable 128-255."""
EXIT_HELD: Final = 80
"""Held by the control plane (a ``hold``: the job failed past its restart budget). Below
128 (Kubeflow's permanent range) and outside sysexits' 64-78 ("retry later")."""
EXIT_STOPPED: Final = 81
"""Stopped by a ``stop`` command (an operator or the control plane ended the job): not a
success, and not to be retried. Beside 80, below 128 (Kubeflow's permanent range)."""
EXIT_SIGTERM: Final = 128 + signal.SIGTERM
