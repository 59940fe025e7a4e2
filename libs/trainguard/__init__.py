"""trainguard: training reliability for long PyTorch jobs.

Trainers use :class:`trainguard.Guard` (and ``trainguard.torch`` for tensor helpers,
imported on first use so the services never load torch); everything else in this package
is the contract and runtime the services share.
"""

from __future__ import annotations

import importlib
from typing import Any

from .client import Guard

__version__ = "0.1.0"
__all__ = ["Guard", "__version__", "torch"]


def __getattr__(name: str) -> Any:
    if name == "torch":
        return importlib.import_module(".torch", __name__)
    raise AttributeError(f"module 'trainguard' has no attribute {name!r}")
