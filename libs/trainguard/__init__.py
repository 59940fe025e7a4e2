"""trainguard: training reliability for long PyTorch jobs.

Trainers use :class:`trainguard.Guard` (and ``trainguard.torch`` for tensor helpers);
everything else in this package is the contract and runtime the services share.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["__version__"]
