"""A PyTorch Lightning trainer under trainguard: a tiny language model on synthetic tokens
(built here, nothing downloaded), DDP over gloo on CPU, the ``trainguard.lightning``
callback. docs/lightning.md walks through it.

    trainguard launch --job lit --nproc-per-node 2 ... -m -- \\
        trainguard.examples.lightning_trainer --root /ckpt --steps 200
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainguard.lightning

VOCAB, WIDTH, SEQ = 64, 32, 16


class TinyLM(pl.LightningModule):
    def __init__(self, step_time: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 64), nn.GELU(), nn.Linear(64, VOCAB))
        self.step_time = step_time

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, target = batch
        if self.step_time:
            time.sleep(self.step_time)  # a step long enough to be caught in
        logits = self.mlp(self.embed(tokens)).mean(dim=1)
        return nn.functional.cross_entropy(logits, target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def synthetic(samples: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (samples, SEQ), generator=g)
    return TensorDataset(tokens, tokens[:, 0].clone())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", default=None, help="default: TRAINGUARD_JOB")
    p.add_argument("--root", default=os.environ.get("TRAINGUARD_CHECKPOINT_ROOT", "checkpoints"),
                   help="checkpoint root, shared by every host")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--ckpt-every", type=int, default=10)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    guard = trainguard.lightning.Trainguard(job=args.job, root=args.root,
                                            checkpoint_every=args.ckpt_every)
    trainer = pl.Trainer(
        accelerator="cpu", devices=local, num_nodes=max(1, world // local),
        strategy=DDPStrategy(process_group_backend="gloo"), max_steps=args.steps,
        callbacks=[guard], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False)
    loader = DataLoader(synthetic(8 * args.steps * world), batch_size=8, shuffle=True)
    trainer.fit(TinyLM(args.step_time), loader, ckpt_path=guard.resume_path())


if __name__ == "__main__":
    main()
