"""Memory snapshots' cost: the training loop's step time with and without them, same run.

A model of linear layers with AdamW trains on the CPU; the same loop runs ``--steps``
steps without snapshots (the baseline, half before and half after), and as many with
``MemorySnapshots("auto")`` (what ``Checkpointer`` takes by default) after ``--settle``
steps in which ``auto`` finds its interval. Reported per model size: the snapshot's cost
(the copy on the training thread, the background check's CPU time, which a CPU-trained
state pays too), the interval ``auto`` chose, that cost per step as a share of the
baseline's step time, the measured mean step times (noisier than the share on a busy
machine), and host memory held against the rank's state (``keep`` copies).
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


def run(params: int, steps: int, settle: int) -> dict[str, Any]:
    model, opt = trainer(params)
    x = torch.randn(16, WIDTH)
    for _ in range(10):  # warm-up: allocations, the optimizer's state, page faults
        step(model, opt, x)
    state = sum(t.numel() * t.element_size() for _, t in live_state(model, opt))
    base: list[float] = []

    def baseline(n: int) -> None:
        for _ in range(n):
            t0 = time.perf_counter()
            step(model, opt, x)
            base.append(time.perf_counter() - t0)

    baseline(steps // 2)
    mem = MemorySnapshots("auto")
    snap: list[float] = []
    copies: list[float] = []
    taken = 0
    for n in range(settle + steps):  # ``auto`` settles on its interval first
        t0 = time.perf_counter()
        step(model, opt, x)
        done = mem.step_done(n, model, opt)
        if n >= settle:
            snap.append(time.perf_counter() - t0)
            if done:
                taken += 1
                copies.append(mem.copy_seconds)
    mem.held(below=settle + steps)  # the last checks done
    held, check = mem.nbytes, mem.check_seconds
    mem.close()
    baseline(steps - steps // 2)  # before and after: drift falls on both
    without, with_ = statistics.mean(base), statistics.mean(snap)
    every = len(snap) / taken if taken else float("inf")
    copy = statistics.median(copies) if copies else 0.0
    return {
        "params": sum(p.numel() for p in model.parameters()), "state_bytes": state,
        "step_s_mean_without": without, "step_s_mean_with": with_,
        "overhead_pct": 100 * (with_ - without) / without,
        "cost_share_pct": 100 * (copy + check) / every / statistics.median(base),
        "copy_s_median": statistics.median(copies) if copies else None,
        "check_cpu_s": check, "snapshots": taken, "steps_with": len(snap),
        "every_auto": round(len(snap) / taken, 1) if taken else None,
        "held_bytes": held, "held_x_state": held / state,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--params", default="4e6,40e6", help="model sizes, comma-separated")
    p.add_argument("--steps", type=int, default=40, help="steps measured per mode")
    p.add_argument("--settle", type=int, default=20,
                   help="steps with snapshots before measuring (auto finds its interval)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()
    results = {}
    print("| parameters | state | copy (loop) | check (background CPU) | every (auto) | cost "
          "per step | step without / with (measured) | host memory |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for size in (int(float(v)) for v in args.params.split(",")):
        r = run(size, args.steps, args.settle)
        results[str(size)] = r
        copy = f"{1000 * r['copy_s_median']:.1f} ms" if r["copy_s_median"] else "-"
        print(f"| {r['params'] / 1e6:.0f}M | {r['state_bytes'] / 2**20:.0f} MiB | {copy} | "
              f"{1000 * r['check_cpu_s']:.0f} ms | {r['every_auto']} steps | "
              f"{r['cost_share_pct']:.1f}% | {1000 * r['step_s_mean_without']:.0f} / "
              f"{1000 * r['step_s_mean_with']:.0f} ms ({r['overhead_pct']:+.0f}%) | "
              f"{r['held_x_state']:.1f}x state |", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
