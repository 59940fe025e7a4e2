"""The toy trainer's ``--loader stateful`` data: numbered samples through torchdata's
``StatefulDataLoader``, so a test can count which samples each step trained on.

Sample ``i`` is made from ``i`` alone (its tokens, target and a loss weight of 1), and a
``DistributedSampler`` (shuffled, seeded, a new order each epoch) deals them to the ranks:
the stream a rank reads is its position in that deal, which ``trainguard.torch.Batches``
saves, restores and hands over.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset, DistributedSampler

SAMPLES = 512
BATCH = 8


class NumberedSamples(Dataset[dict[str, Any]]):
    """``SAMPLES`` samples of the tiny model's shape, each a function of its number."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(1_000_003 + i)
        return {"id": i, "tokens": torch.randint(0, 64, (16,), generator=g),
                "target": int(torch.randint(0, 64, (1,), generator=g)),
                "weight": torch.tensor(1.0)}


def stateful_loader(seed: int, world: int, rank: int) -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = NumberedSamples()
    sampler: DistributedSampler[dict[str, Any]] = DistributedSampler(
        data, num_replicas=world, rank=rank, shuffle=True, seed=seed)
    # A generator of its own: creating an iterator takes no draw from torch's global RNG.
    return StatefulDataLoader(data, batch_size=BATCH, sampler=sampler,
                              generator=torch.Generator().manual_seed(seed))


def weighted_loss(out: torch.Tensor, target: torch.Tensor, weight: torch.Tensor
                  ) -> torch.Tensor:
    """Cross-entropy weighted per sample (a NaN weight poisons the whole loss)."""
    per = torch.nn.functional.cross_entropy(out, target, reduction="none")
    return (per * weight).sum() / weight.numel()
