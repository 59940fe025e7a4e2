"""One seed, every source of randomness a trainer has: a resumed job retraces its curve.

``seeds = seed_everything(1234)`` at the top of the trainer, before the model, the
optimizer and the loaders are built, and ``Guard(..., seed=1234)`` beside it: the Guard's
environment record and the run record written beside every checkpoint (``run.json``) then
name the seed. With the same seed, the same code and data, and the loader's position
restored from the checkpoint, a job that crashed and resumed produces the same loss curve
as one that ran straight through: bit for bit on the CPU; on a GPU as far as the
deterministic kernels reach (below).

What it sets, and why:

* ``random.seed``, ``numpy.random.seed`` (when NumPy is installed; it is not required) and
  ``torch.manual_seed`` (which seeds every CUDA device too): the three global generators a
  trainer's code, its augmentations and torch's initialisers draw from.
* With ``deterministic`` (the default):

  * ``torch.use_deterministic_algorithms(True)``: torch picks deterministic kernels, and
    an operation that has none **raises** ``RuntimeError`` naming it (``warn_only`` stays
    False). A warning scrolls past in a long job's log and its curve still drifts; the
    error says at the first step which operation needs replacing. A trainer that accepts
    such an operation calls ``torch.use_deterministic_algorithms(True, warn_only=True)``
    after this, or passes ``deterministic=False``.
  * ``torch.backends.cudnn.deterministic = True``, ``torch.backends.cudnn.benchmark =
    False``: cuDNN's autotuner times candidate convolution algorithms at the first call and
    keeps the fastest, which may differ between two runs (and differ in their rounding).
  * ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` in ``os.environ`` unless already set: cuBLAS
    (CUDA >= 10.2) is deterministic only with a fixed workspace, and without one torch's
    deterministic mode raises at the first matrix multiply on a GPU. cuBLAS reads the
    variable when CUDA initialises: if CUDA was initialised already, a warning is logged
    (set it in the launcher's environment, or call this before touching the GPU).
  * ``PYTHONHASHSEED`` cannot be changed once Python runs (``hash()`` of a string, and so
    a set's iteration order, is fixed at start): if it is not set to a number, a warning
    says how to set it.

* Data loaders: :meth:`Seeds.generator` gives each ``DataLoader`` a generator of its own
  (its shuffling and its workers' base seed), so creating an iterator takes nothing from
  the global generator and the model's draws do not depend on how many loaders there are;
  :attr:`Seeds.worker_init_fn` seeds ``random`` and NumPy in each worker from the seed
  torch gives that worker, as PyTorch's reproducibility notes recommend.

What it cannot do: make a nondeterministic data pipeline (threads, a network source,
``os.listdir`` order) deterministic, or restore the generators' state at a resume. The
loader's position comes back with the checkpoint (:class:`~trainguard.torch.data.Batches`);
a trainer that draws from the global generators during training restores their states from
its checkpoint too.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("trainguard.torch")

CUBLAS_WORKSPACE = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_WORKSPACE_VALUE = ":4096:8"
"""The larger of the two workspace settings cuBLAS documents as deterministic (about 24 MiB
per stream; ``:16:8`` costs less memory and may be slower)."""


def seed_worker(worker_id: int) -> None:
    """A ``DataLoader``'s ``worker_init_fn``: seed ``random`` and NumPy in this worker from
    the seed torch gave it (the loader's base seed plus ``worker_id``), so random draws made
    in a ``Dataset``'s ``__getitem__`` are the same in every run with the same seed.

    A module-level function: it pickles by name for the ``spawn`` and ``forkserver`` start
    methods.
    """
    worker_seed = torch.initial_seed() % 2**32
    random.seed(worker_seed)
    numpy = _numpy()
    if numpy is not None:
        numpy.random.seed(worker_seed)


@dataclass(frozen=True)
class Seeds:
    """What :func:`seed_everything` applied, and what a trainer hands its loaders."""

    seed: int
    deterministic: bool = True

    def generator(self) -> torch.Generator:
        """A fresh CPU ``torch.Generator`` seeded from :attr:`seed`:
        ``DataLoader(..., generator=seeds.generator())``. Each call starts over, so two
        loaders built alike give the same order."""
        gen = torch.Generator()
        gen.manual_seed(self.seed)
        return gen

    @property
    def worker_init_fn(self) -> Callable[[int], None]:
        """``DataLoader(..., worker_init_fn=seeds.worker_init_fn)``: :func:`seed_worker`."""
        return seed_worker


def seed_everything(seed: int, *, deterministic: bool = True) -> Seeds:
    """Seed Python, NumPy and torch (every CUDA device) with ``seed`` and, with
    ``deterministic``, turn on torch's deterministic algorithms and cuDNN's and cuBLAS's
    deterministic settings (see the module's notes for why each is there).

    Call it first in the trainer, on every rank, with the same seed (a rank that needs its
    own stream, such as dropout in data parallelism, derives it: ``seed + rank``), and pass
    the seed to ``Guard(seed=...)`` too, so the run record names it. ``deterministic=False``
    seeds only: the deterministic flags are left as they are.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed={seed!r}: an int")
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed={seed}: between 0 and 2**63 - 1")
    random.seed(seed)
    numpy = _numpy()
    if numpy is not None:
        numpy.random.seed(seed % 2**32)  # NumPy's legacy seed takes 32 bits
    torch.manual_seed(seed)  # seeds every CUDA device as well
    if deterministic:
        if CUBLAS_WORKSPACE not in os.environ:
            os.environ[CUBLAS_WORKSPACE] = CUBLAS_WORKSPACE_VALUE
            if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
                log.warning("trainguard: CUDA was initialised before seed_everything set "
                            "%s=%s; cuBLAS reads it at initialisation, so matrix "
                            "multiplies may not be deterministic. Set it in the launcher's "
                            "environment or call seed_everything before using the GPU",
                            CUBLAS_WORKSPACE, CUBLAS_WORKSPACE_VALUE)
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    hashseed = os.environ.get("PYTHONHASHSEED", "")
    if not hashseed.strip().isdigit():
        log.warning("trainguard: PYTHONHASHSEED is %s: hash() of a string, and so the order "
                    "of sets of strings, changes from run to run, and it cannot be set once "
                    "Python runs. Start the job with it fixed, e.g. "
                    "`PYTHONHASHSEED=0 torchrun ...` (or `env: PYTHONHASHSEED=0` in the "
                    "launcher)", f"{hashseed!r}" if hashseed else "not set")
    return Seeds(seed=seed, deterministic=deterministic)


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy
