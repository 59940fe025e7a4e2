"""``trainguard.torch``: the torch helpers a trainer uses beside its Guard (Checkpointer,
DDP instrumentation, batch and gradient statistics, device values, seeding), and the in-place
recovery's public entry points.

They type against the :class:`~trainguard.recovery.handle.GuardHandle` Protocol, never the
Guard itself (import-linter forbids ``trainguard.client``). Imported only by trainers, never
by the services, which run without torch installed.
"""

from __future__ import annotations

from trainguard.recovery.ddprebuild import InPlaceDDP
from trainguard.recovery.fsdprebuild import InPlaceFSDP, fsdp
from trainguard.recovery.inplace import InPlace, init_process_group
from trainguard.recovery.peerloss import is_peer_loss

from .batches import BatchCheck, check_batch
from .checkpoint import Checkpointer
from .data import Batches
from .ddp import ddp, instrument_ddp
from .seed import Seeds, seed_everything
from .stats import (
    fingerprint,
    flip_bit,
    grad_norm,
    nonfinite,
    nonfinite_grad_names,
    poison_with_nan,
)

__all__ = [
    "BatchCheck",
    "Batches",
    "Checkpointer",
    "InPlace",
    "InPlaceDDP",
    "InPlaceFSDP",
    "Seeds",
    "check_batch",
    "ddp",
    "fingerprint",
    "flip_bit",
    "fsdp",
    "grad_norm",
    "init_process_group",
    "instrument_ddp",
    "is_peer_loss",
    "nonfinite",
    "nonfinite_grad_names",
    "poison_with_nan",
    "seed_everything",
]
