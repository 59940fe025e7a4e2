"""``trainguard.torch``: the torch-side helpers of the client.

Imported only by trainers (and the agent's launcher), never by the services, which must
run without torch installed.
"""

from __future__ import annotations

from .checkpoint import Checkpointer
from .ddp import instrument_ddp
from .ddprebuild import InPlaceDDP, ddp
from .inplace import InPlace, init_process_group
from .peerloss import is_peer_loss
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
    "InPlace",
    "InPlaceDDP",
    "check_batch",
    "ddp",
    "fingerprint",
    "flip_bit",
    "grad_norm",
    "init_process_group",
    "instrument_ddp",
    "is_peer_loss",
    "nonfinite",
    "nonfinite_grad_names",
    "poison_with_nan",
]
