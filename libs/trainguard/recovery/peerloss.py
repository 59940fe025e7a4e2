"""Which exceptions mean "a peer is gone" (recovered in place) and which are the trainer's own.

A rank recovers in place only from a failed collective: torch's ``DistError`` family, or
the plain ``RuntimeError`` that gloo and NCCL raise when a peer's process or sockets went
away (gloo: ``[.../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:PORT: Connection
reset by peer``). Everything else — ``DrillCrash``, a ``ValueError``, a ``RuntimeError`` from a
shape mismatch or an out-of-memory — is the trainer's error and goes on up: absorbing it
would run the same failing step forever.
"""

from __future__ import annotations

from typing import Final

from trainguard.contract.errors import DrillCrash

PEER_LOSS_TEXTS: Final = (
    # gloo's TCP transport (pair.cc), when the peer's process died or its socket closed
    "connection reset by peer",
    "connection closed by peer",
    "connection refused",
    "broken pipe",
    "socket closed",
    "gloo/transport/tcp",
    # NCCL, through ProcessGroupNCCL and its watchdog
    "nccl communicator was aborted",
    "ncclremoteerror",
    "ncclsystemerror",
    "remote process exited",
    "nccl error",
    "process group watchdog",
    "watchdog caught collective operation timeout",
)
"""Lower-case fragments of the messages torch's backends raise for a lost peer. Matched
only against ``RuntimeError`` (the type those backends raise)."""


def is_peer_loss(error: BaseException) -> bool:
    """True for a failed collective or lost peer; False for the trainer's own errors."""
    if isinstance(error, DrillCrash) or not isinstance(error, RuntimeError):
        return False
    if _is_dist_error(error):
        return True
    text = str(error).lower()
    return any(fragment in text for fragment in PEER_LOSS_TEXTS)


def _is_dist_error(error: BaseException) -> bool:
    import torch.distributed as dist

    return isinstance(error, dist.DistError)
