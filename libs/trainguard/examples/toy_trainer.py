"""A small instrumented data-parallel trainer: the five lines of the README, for real.

Runs under torchrun (gloo on CPU) in the end-to-end tests, the demo and the benchmarks.
Each step is mostly a fixed sleep (``--step-time``) plus a small model's forward/backward,
so two busy cores do not turn a clean run into stragglers. ``--model lm`` trains a small
character-level transformer language model on a generated corpus; ``--model tiny`` an MLP.
Gradients are averaged with an explicit all-reduce in a ``comm`` phase, or by DDP with
``--ddp`` (timed by ``trainguard.torch.instrument_ddp``). With ``--ckpt-root`` it saves
through ``trainguard.torch.Checkpointer`` and resumes from ``guard.resume_point()``.
Batches depend only on (seed, rank, step), so a resumed run sees the same data.

    python -m torch.distributed.run --nproc-per-node 2 -m trainguard.examples.toy_trainer \
        --job demo --steps 200
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import trainguard
import trainguard.torch as tgt


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", default=os.environ.get("TRAINGUARD_JOB", "toy"))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--step-time", type=float, default=0.02,
                   help="seconds of simulated compute per step (default 0.02)")
    p.add_argument("--ddp", action="store_true", help="average gradients with DDP")
    p.add_argument("--model", choices=("tiny", "lm"), default="tiny")
    p.add_argument("--ckpt-root", help="save checkpoints here and resume from them")
    p.add_argument("--ckpt-every", type=int, default=20,
                   help="steps between checkpoints until the coordinator sets the interval")
    p.add_argument("--heartbeat", type=float, default=0.25)
    p.add_argument("--fingerprint-every", type=int, default=10)
    p.add_argument("--sync-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--raise-at", metavar="RANK:STEP", default=None,
                   help="raise an exception on RANK at STEP (first attempt only): a crash "
                        "without trainguard's drills, for baselines")
    p.add_argument("--raise-message", default="RuntimeError raised by --raise-at")
    p.add_argument("--pg-timeout", type=float, default=120.0,
                   help="process-group timeout in seconds (default 120)")
    return p.parse_args(argv)


VOCAB = 64
SEQ = 32
_WORDS = ("the", "gpu", "rank", "step", "loss", "fell", "rose", "node", "saved", "a", "of",
          "checkpoint", "gradient", "train", "model", "and", "slow", "fast", "all", "reduce")


def corpus(seed: int = 0, length: int = 200_000) -> torch.Tensor:
    """A generated text corpus (a seeded Markov chain over a few words), as char ids."""
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(0, len(_WORDS), (length // 5,), generator=g).tolist()
    text = " ".join(_WORDS[(w + i // 7) % len(_WORDS)] for i, w in enumerate(words))
    return torch.tensor([ord(c) % VOCAB for c in text[:length]], dtype=torch.long)


class CharLM(nn.Module):
    """A small transformer language model (2 layers, 64-wide)."""

    def __init__(self, d: int = 64, layers: int = 2, heads: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.zeros(SEQ, d))
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.embed(tokens) + self.pos, mask=self.mask, is_causal=True)
        out: torch.Tensor = self.head(h)
        return out


class TinyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mlp(self.embed(tokens)).mean(dim=1)
        return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model: nn.Module = CharLM() if args.model == "lm" else TinyModel()
    text = corpus(args.seed) if args.model == "lm" else None
    guard = trainguard.Guard(job=args.job, heartbeat_interval=args.heartbeat,
                             fingerprint_every=args.fingerprint_every,
                             sync_every=args.sync_every, seed=args.seed,
                             checkpoint_every=args.ckpt_every if args.ckpt_root else None)
    if args.ddp:
        model = nn.parallel.DistributedDataParallel(model)
        tgt.instrument_ddp(model, guard)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    guard.attach(model, optimizer)
    ckpt = tgt.Checkpointer(guard, args.ckpt_root) if args.ckpt_root else None
    start = 0
    if ckpt is not None:
        point = guard.resume_point()
        if point is not None:
            start = ckpt.load(point, model, optimizer) + 1
            print(f"rank {rank}: resumed from step {point.step}", file=sys.stderr, flush=True)
    fail_rank, fail_step = (int(x) for x in args.raise_at.split(":")) if args.raise_at \
        else (-1, -1)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    for step in range(start, args.steps):
        if rank == fail_rank and step == fail_step and first_attempt:
            raise RuntimeError(args.raise_message)
        with guard.step(step) as s:
            with s.phase("data"):
                data = torch.Generator().manual_seed(args.seed * 1_000_003 + rank * 7919 + step)
                if text is not None:
                    at = torch.randint(0, len(text) - SEQ - 1, (8,), generator=data)
                    tokens = torch.stack([text[i:i + SEQ] for i in at.tolist()])
                    target = torch.stack([text[i + 1:i + SEQ + 1] for i in at.tolist()])
                else:
                    tokens = torch.randint(0, 64, (8, 16), generator=data)
                    target = torch.randint(0, 64, (8,), generator=data)
            with s.phase("compute"):
                time.sleep(args.step_time)
                out = model(tokens)
                loss = nn.functional.cross_entropy(out.reshape(-1, out.size(-1)),
                                                   target.reshape(-1))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()  # type: ignore[no-untyped-call]
            if not args.ddp:
                with s.phase("comm"):
                    for p in model.parameters():
                        if p.grad is not None:
                            dist.all_reduce(p.grad)
                            p.grad /= world
            s.report(loss=loss.detach(), grad_norm=tgt.grad_norm(model), samples=8)
            optimizer.step()
        if ckpt is not None and guard.should_checkpoint(step):
            ckpt.save(step, model, optimizer)
    if ckpt is not None:
        ckpt.close()
    guard.close()
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: finished {args.steps} steps", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
