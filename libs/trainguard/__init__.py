"""trainguard: training reliability for long PyTorch jobs.

Trainers use :class:`trainguard.Guard` and ``trainguard.torch``; both load on first use, so
``import trainguard`` costs a service nothing it does not run (no client, no torch) and a
rank nothing of the control plane. The packages, lowest layer first (docs/design.md,
"Layers"; import-linter checks them in ``make lint``): ``contract``, ``core``, ``runtime``
and ``analysis``, ``recovery``, ``client``, ``torch``, then ``agent`` and ``services``, and
the ``cli`` on top.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
__all__ = ["Guard", "__version__", "torch"]


def __getattr__(name: str) -> Any:
    if name == "Guard":
        return importlib.import_module(".client", __name__).Guard
    if name == "torch":
        return importlib.import_module(".torch", __name__)
    raise AttributeError(f"module 'trainguard' has no attribute {name!r}")
