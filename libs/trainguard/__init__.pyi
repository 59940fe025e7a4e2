# What type checkers see of `import trainguard`: the names __init__.py loads on first use
# (a stub, so the runtime package imports no client and the layers stay as they are).
from . import torch as torch
from .client import Guard as Guard

__version__: str
__all__ = ["Guard", "__version__", "torch"]
