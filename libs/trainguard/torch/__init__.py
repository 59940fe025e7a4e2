"""``trainguard.torch``: the torch-side helpers of the client.

Imported only by trainers (and the agent's launcher), never by the services, which must
run without torch installed.
"""

from __future__ import annotations

from .checkpoint import Checkpointer
from .ddp import instrument_ddp
from .stats import (
    BatchCheck,
    check_batch,
    fingerprint,
    flip_bit,
    grad_norm,
    nonfinite,
    nonfinite_grad_names,
    poison_with_nan,
)

__all__ = [
    "BatchCheck",
    "Checkpointer",
    "check_batch",
    "fingerprint",
    "flip_bit",
    "grad_norm",
    "instrument_ddp",
    "nonfinite",
    "nonfinite_grad_names",
    "poison_with_nan",
]
