"""The README's "Instrumenting a trainer" block, run as written.

The block is read from README.md at run time (never copied here) and executed in a
namespace that holds what it leaves to the reader: ``model``, ``optimizer``, ``loader``,
``total`` and ``sync_gradients``. Two literals are a deployment's, not the loop's, and are
replaced: the backend (``"nccl"``: gloo on this CPU) and the checkpoint root (``"/ckpt"``:
``TRAINGUARD_CHECKPOINT_ROOT``). Under ``trainguard launch`` a replacement rank runs this
file from the top, as a user's script would be.

    trainguard launch --job llama-8b ... -m -- tests.e2e.readme_trainer --steps 150
"""

from __future__ import annotations

import argparse
import os
import re
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainguard.contract import envnames
from trainguard.examples.samples import stateful_loader

README = Path(__file__).parents[2] / "README.md"


def readme_block() -> str:
    text = README.read_text()
    section = text[text.index("## Instrumenting a trainer"):]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found is not None, "the README's trainer block"
    return found.group(1)


class Model(nn.Module):
    """The README's ``model(batch).loss``: the toy's tiny model, with its loss."""

    def __init__(self, step_time: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64))
        self.step_time = step_time

    def forward(self, batch: dict[str, Any]) -> SimpleNamespace:
        time.sleep(self.step_time)  # a step long enough to be caught in
        out = self.mlp(self.embed(batch["tokens"])).mean(dim=1)
        return SimpleNamespace(loss=nn.functional.cross_entropy(out, batch["target"]))


def sync_gradients() -> None:
    world = dist.get_world_size()
    for p in namespace["model"].parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world


namespace: dict[str, Any] = {}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--step-time", type=float, default=0.05)
    args = p.parse_args()
    torch.manual_seed(0)
    model = Model(args.step_time)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    namespace.update(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                     loader=stateful_loader(0, world, rank), total=args.steps,
                     sync_gradients=sync_gradients)
    code = readme_block().replace('"nccl"', '"gloo"').replace(
        '"/ckpt"', repr(os.environ[envnames.CHECKPOINT_ROOT]))
    exec(compile(code, str(README), "exec"), namespace)


if __name__ == "__main__":
    main()
