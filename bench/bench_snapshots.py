"""Memory snapshots' cost: the training loop's step time with and without them, same run.

A model of linear layers with AdamW trains on the CPU; the same loop runs ``--steps``
steps without snapshots (the baseline), then as many with ``MemorySnapshots("auto")``
(what ``Checkpointer`` takes by default), alternating in rounds so drift in the machine's
load falls on both. Reported per model size: the median step time of each, the overhead,
the copy's own time on the training thread, the interval ``auto`` chose, and host memory
held against the rank's state (``keep`` copies).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from torch import nn

from trainguard.torch.snapshots import MemorySnapshots, live_state

WIDTH = 2048


def trainer(params: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers = max(1, round(params / (WIDTH * WIDTH + WIDTH)))
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def run(params: int, steps: int, rounds: int) -> dict[str, Any]:
    model, opt = trainer(params)
    x = torch.randn(16, WIDTH)
    for _ in range(2):  # warm-up: allocations, the optimizer's state
        step(model, opt, x)
    state = sum(t.numel() * t.element_size() for _, t in live_state(model, opt))
    mem = MemorySnapshots("auto")
    base: list[float] = []
    snap: list[float] = []
    copies: list[float] = []
    taken = 0
    n = 0
    for _ in range(rounds):
        for _ in range(steps):
            t0 = time.perf_counter()
            step(model, opt, x)
            base.append(time.perf_counter() - t0)
        for _ in range(steps):
            t0 = time.perf_counter()
            step(model, opt, x)
            if mem.step_done(n, model, opt):
                taken += 1
                copies.append(mem.copy_seconds)
            snap.append(time.perf_counter() - t0)
            n += 1
    mem.held(below=n + 1)  # the last checks done
    held = mem.nbytes
    mem.close()
    b, s = statistics.median(base), statistics.mean(snap)
    mean_base = statistics.mean(base)
    return {
        "params": sum(p.numel() for p in model.parameters()), "state_bytes": state,
        "step_s_median_without": b, "step_s_mean_without": mean_base, "step_s_mean_with": s,
        "overhead_pct": 100 * (s - mean_base) / mean_base,
        "copy_s_median": statistics.median(copies) if copies else None,
        "snapshots": taken, "steps_with": len(snap),
        "every_auto": round(len(snap) / taken, 1) if taken else None,
        "held_bytes": held, "held_x_state": held / state,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--params", default="4e6,40e6", help="model sizes, comma-separated")
    p.add_argument("--steps", type=int, default=15, help="steps per round and mode")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()
    results = {}
    print("| parameters | state | step without | step with | overhead | copy | every "
          "(auto) | host memory |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for size in (int(float(v)) for v in args.params.split(",")):
        r = run(size, args.steps, args.rounds)
        results[str(size)] = r
        copy = f"{1000 * r['copy_s_median']:.1f} ms" if r["copy_s_median"] else "-"
        print(f"| {r['params'] / 1e6:.0f}M | {r['state_bytes'] / 2**20:.0f} MiB | "
              f"{1000 * r['step_s_mean_without']:.0f} ms | {1000 * r['step_s_mean_with']:.0f} ms "
              f"| {r['overhead_pct']:+.1f}% | {copy} | {r['every_auto']} steps | "
              f"{r['held_x_state']:.1f}x state |", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
