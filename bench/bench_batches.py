"""Batch checks' cost: a CPU training step with and without ``BatchCheck``, same run.

Two realistic CPU steps, each a forward, backward and SGD step on one thread: a small
transformer LM on ``{"input_ids", "attention_mask", "labels"}`` (int64, (B, S)) and a
small CNN on ``{"pixel_values": float32 (B, 3, 64, 64), "labels"}``. Each runs without a
check (the baseline), with ``BatchCheck`` on every step (the default) and every 10th step,
in interleaved rounds (the order rotates each round, so drift falls on every mode alike):
in one process (world size 1: no agreement), then in a 2-rank gloo group on loopback
(DDP on the training group; the check's skip agreement all-reduces one flag on its side
group every checked step). Reported: the median step time per mode, the check's own time
inside the loop (the call, timed around it; with 2 ranks it includes the agreement) and
its share of the baseline's step, beside the measured difference of the step medians
(noisy on a busy machine), and ``check_batch`` alone on each batch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch
from bench_client import Block  # the same transformer block
from torch import nn

import trainguard
from trainguard.contract.evidence import BatchFault
from trainguard.runtime.embedded import free_port
from trainguard.torch import BatchCheck, check_batch

MODES = ("off", "every 1", "every 10")
VOCAB, SEQ, BATCH_LM, BATCH_IMG = 4096, 64, 8, 32


@dataclass
class Handle:
    """What ``guard.step(n)`` gives the check (:class:`trainguard.torch.batches.StepHandle`)."""

    n: int
    batch_fault: BatchFault | None = None


class TinyLM(nn.Module):
    def __init__(self, d: int = 128, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.head = nn.Linear(d, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x, pad = self.embed(input_ids), attention_mask == 0
        for block in self.blocks:
            x = block(x, pad)
        out: torch.Tensor = self.head(x)
        return out


def small_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 32, 3, 2, 1), nn.ReLU(), nn.Conv2d(32, 64, 3, 2, 1),
                         nn.ReLU(), nn.Conv2d(64, 64, 3, 2, 1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def lm_batches(n: int) -> list[dict[str, torch.Tensor]]:
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (BATCH_LM, SEQ))
        mask = torch.ones(BATCH_LM, SEQ, dtype=torch.int64)
        mask[:, SEQ - torch.randint(0, SEQ // 4, ()).item():] = 0  # right padding
        out.append({"input_ids": ids, "attention_mask": mask,
                    "labels": torch.where(mask.bool(), ids, -100)})
    return out


def image_batches(n: int) -> list[dict[str, torch.Tensor]]:
    return [{"pixel_values": torch.randn(BATCH_IMG, 3, 64, 64),
             "labels": torch.randint(0, 10, (BATCH_IMG,))} for _ in range(n)]


def trainer(kind: str) -> tuple[nn.Module, Any, list[dict[str, torch.Tensor]]]:
    torch.manual_seed(0)
    if kind == "lm":
        model: nn.Module = TinyLM()

        def loss_of(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
            logits = m(b["input_ids"], b["attention_mask"])
            return nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                               b["labels"].reshape(-1), ignore_index=-100)
        return model, loss_of, lm_batches(8)
    model = small_cnn()

    def loss_img(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(m(b["pixel_values"]), b["labels"])
    return model, loss_img, image_batches(8)


def run(kind: str, rounds: int, per_block: int, distributed: bool) -> dict[str, Any]:
    model, loss_of, batches = trainer(kind)
    params = sum(p.numel() for p in model.parameters())
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = trainguard.Guard(job="bench", enabled=False)
    checks = {"every 1": BatchCheck(guard, every=1, skip=True),
              "every 10": BatchCheck(guard, every=10, skip=True)}
    n = 0

    def step(mode: str) -> float:
        nonlocal n
        batch = batches[n % len(batches)]
        t0 = time.perf_counter()
        if mode != "off":
            batch = checks[mode](Handle(n), batch)
        spent = time.perf_counter() - t0
        loss = loss_of(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        n += 1
        return spent

    for _ in range(5):  # warm-up: allocations, DDP's buckets, the first checks
        for mode in MODES:
            step(mode)
    raw: dict[str, Any] = {"params": params, "steps": {m: [] for m in MODES},
                           "check": {m: [] for m in MODES}, "due": {m: [] for m in MODES}}
    for r in range(rounds):
        for mode in MODES[r % 3:] + MODES[:r % 3]:  # the same order on every rank
            for _ in range(per_block):
                due = mode != "off" and checks[mode].due(n)
                t0 = time.perf_counter()
                raw["check"][mode].append(step(mode))
                raw["steps"][mode].append(time.perf_counter() - t0)
                raw["due"][mode].append(due)
    assert not any(c.faults for c in checks.values())
    return raw


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the steps. With 2 ranks a step takes as long as its slower rank, and
    the check's agreement waits at the all-reduce for the later rank (a wait the training
    all-reduce would have taken anyway): the check's cost of a step is its time on the rank
    that arrived last, the smaller of the two."""
    def per_step(field: str, mode: str, pick: Any) -> list[float]:
        return [pick(v) for v in zip(*(r[field][mode] for r in ranks), strict=True)]

    base = statistics.median(per_step("steps", "off", max))
    out: dict[str, Any] = {"params": ranks[0]["params"], "step_ms_off": 1e3 * base,
                           "steps_each": len(ranks[0]["steps"]["off"])}
    for mode in MODES[1:]:
        key = mode.replace(" ", "")
        times = per_step("check", mode, min)
        due = ranks[0]["due"][mode]
        checked = [t for t, d in zip(times, due, strict=True) if d]
        skipped = [t for t, d in zip(times, due, strict=True) if not d]
        # per step: a checked step's median cost at the share of steps checked, plus the
        # rest's (the ``due`` test); medians, so one preempted call does not dominate
        cost = sum(len(ts) * statistics.median(ts) for ts in (checked, skipped) if ts) \
            / len(times)
        med = statistics.median(per_step("steps", mode, max))
        out[f"step_ms_{key}"] = 1e3 * med
        out[f"check_us_{key}"] = 1e6 * cost
        out[f"check_pct_{key}"] = 100 * cost / base
        out[f"measured_pct_{key}"] = 100 * (med - base) / base
    return out


def check_alone(reps: int) -> dict[str, float]:
    out = {}
    for kind, batch in (("lm", lm_batches(1)[0]), ("image", image_batches(1)[0])):
        reference: dict[str, tuple[torch.dtype, int]] = {}
        for _ in range(10):
            check_batch(batch, reference=reference)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            check_batch(batch, reference=reference)
            times.append(time.perf_counter() - t0)
        out[kind] = 1e6 * statistics.median(times)
    return out


def rank_main(args: argparse.Namespace) -> int:
    """One rank of the 2-rank gloo group (started by :func:`distributed`)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results = {kind: run(kind, args.rounds, args.per_block, True)
               for kind in args.kinds.split(",")}
    rank = dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()
    with open(f"{args.rank_out}.{rank}", "w") as fh:
        json.dump(results, fh)
    return 0


def distributed(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank.json")
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
        procs = [subprocess.Popen([sys.executable, __file__, "--rank-out", out,
                                   "--kinds", args.kinds, "--rounds", str(args.rounds),
                                   "--per-block", str(args.per_block)],
                                  env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
                 for r in range(2)]
        try:
            codes = [p.wait(timeout=300) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if any(codes):
            raise SystemExit(f"a rank failed: exit codes {codes}")
        ranks = []
        for r in range(2):
            with open(f"{out}.{r}") as fh:
                ranks.append(json.load(fh))
        return {kind: summarize([rk[kind] for rk in ranks]) for kind in ranks[0]}


def row(where: str, kind: str, r: dict[str, Any]) -> str:
    model = "transformer LM" if kind == "lm" else "CNN, 64x64 images"
    return (f"| {where} | {model} ({r['params'] / 1e6:.1f}M) | {r['step_ms_off']:.1f} ms | "
            f"{r['step_ms_every1']:.1f} ms ({r['measured_pct_every1']:+.1f}%) | "
            f"{r['step_ms_every10']:.1f} ms ({r['measured_pct_every10']:+.1f}%) | "
            f"{r['check_us_every1']:.0f} µs ({r['check_pct_every1']:.2f}%) | "
            f"{r['check_us_every10']:.1f} µs ({r['check_pct_every10']:.3f}%) |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=12, help="interleaved rounds")
    p.add_argument("--per-block", type=int, default=8, help="steps per mode per round")
    p.add_argument("--kinds", default="lm,image", help="lm, image or both")
    p.add_argument("--reps", type=int, default=2000, help="check_batch alone: calls")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--rank-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_out:
        return rank_main(args)
    torch.set_num_threads(1)
    started = time.monotonic()
    alone = check_alone(args.reps)
    single = {kind: summarize([run(kind, args.rounds, args.per_block, False)])
              for kind in args.kinds.split(",")}
    two = distributed(args)
    print(f"check_batch alone (median of {args.reps}): LM batch {alone['lm']:.1f} µs, "
          f"image batch {alone['image']:.1f} µs\n")
    print("| ranks | model (params) | step, no check | with check, every step (measured) | "
          "every 10 steps (measured) | check per step, every step (share) | "
          "every 10 (share) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for where, res in (("1", single), ("2 (gloo)", two)):
        for kind, r in res.items():
            print(row(where, kind, r))
    load = os.getloadavg()[0]
    print(f"\n{single[next(iter(single))]['steps_each']} steps per mode, load average "
          f"{load:.1f}, {time.monotonic() - started:.0f} s")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"check_batch_us": alone, "world_1": single, "world_2": two,
                       "load_average": load}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
