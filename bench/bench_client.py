"""Client cost: main-thread microseconds per step, and the slowdown of a real CPU step.

1. ``guard.step`` + two phases + ``report`` with a live embedded nats-server (the
   background thread publishes while we measure), median and p99 over many steps.
2. A ~10M-parameter transformer's training step on the CPU with the Guard on vs off
   (interleaved blocks of steps, medians), the Guard reporting loss and grad norm as
   0-dim tensors and fingerprinting every 50 steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn

from trainguard import Guard
from trainguard.runtime.embedded import EmbeddedControlPlane
from trainguard.torch import grad_norm


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def bench_overhead(url: str, steps: int) -> dict[str, float]:
    guard = Guard(job="bench-overhead", rank=0, world_size=1, host="bench", nats_url=url,
                  heartbeat_interval=1.0)
    loss = 0.5
    costs = []
    for i in range(steps):
        t0 = time.perf_counter_ns()
        with guard.step(i) as s:
            with s.phase("data"):
                pass
            with s.phase("compute"):
                pass
            s.report(loss=loss, grad_norm=1.0, tokens=4096)
        costs.append((time.perf_counter_ns() - t0) / 1000)
    stats = guard.stats()
    guard.close()
    warm = costs[steps // 10:]
    return {"median_us": statistics.median(warm), "p99_us": percentile(warm, 0.99),
            "steps": steps, "sent": stats["sent"], "dropped": stats["dropped"]}


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        """``pad``: True where a position is padding (attention skips it)."""
        h = self.ln1(x)
        x = x + self.attn(h, h, h, key_padding_mask=pad, need_weights=False)[0]
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 8192, d: int = 256, layers: int = 6, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.blocks(self.embed(tokens)))
        return out


def bench_training(url: str, blocks: int, per_block: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyLM()
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 8192, (8, 64))
    guard = Guard(job="bench-train", rank=0, world_size=1, host="bench", nats_url=url,
                  fingerprint_every=50)
    guard.attach(model, opt)

    def plain_step() -> None:
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                           tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    n = 0

    def guarded_step() -> None:
        nonlocal n
        with guard.step(n) as s:
            with s.phase("data"):
                batch = tokens
            with s.phase("compute"):
                logits = model(batch[:, :-1])
                loss = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                                   batch[:, 1:].reshape(-1))
                opt.zero_grad(set_to_none=True)
                loss.backward()
            s.report(loss=loss.detach(), grad_norm=grad_norm(model), tokens=batch.numel())
            opt.step()
        n += 1

    for _ in range(3):
        plain_step()
    times: dict[str, list[float]] = {"off": [], "on": []}
    for b in range(blocks):
        order = ("off", "on") if b % 2 == 0 else ("on", "off")
        for mode in order:
            fn = plain_step if mode == "off" else guarded_step
            for _ in range(per_block):
                t0 = time.perf_counter()
                fn()
                times[mode].append(time.perf_counter() - t0)
    guard.close()
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    return {"params": params, "step_ms_off": off * 1e3, "step_ms_on": on * 1e3,
            "slowdown_pct": (on - off) / off * 100, "steps_each": len(times["on"]),
            "note": "grad_norm() adds a fused norm over all gradients; reuse "
                    "clip_grad_norm_'s return value to avoid it"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50_000)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--per-block", type=int, default=10)
    p.add_argument("--out", help="write results as JSON here")
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp, EmbeddedControlPlane(tmp) as plane:
        overhead = bench_overhead(plane.nats.url, args.steps)
        training = bench_training(plane.nats.url, args.blocks, args.per_block)
    result = {"client_overhead": overhead, "client_training": training}
    print("| client measure | value |\n| --- | --- |")
    print(f"| main-thread cost per step (step + 2 phases + report), median | "
          f"{overhead['median_us']:.1f} µs |")
    print(f"| same, p99 | {overhead['p99_us']:.1f} µs |")
    print(f"| CPU training step, {training['params'] / 1e6:.1f}M-param transformer, off / on | "
          f"{training['step_ms_off']:.1f} ms / {training['step_ms_on']:.1f} ms |")
    print(f"| slowdown with the client (incl. grad_norm) | {training['slowdown_pct']:+.2f}% |")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
