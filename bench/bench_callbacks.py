"""The framework callbacks' cost per step on the training thread, beside the hand-written loop.

Each mode runs the same steps with its own Guard on a live embedded nats-server (as
``bench_client.py`` measures the loop; publishing is the Guard's own thread's):

- ``loop``: ``with guard.step(n) as s:``, two phases, ``s.report(loss=...)``: the README's
  loop, the baseline;
- ``lightning``: ``trainguard.lightning.Trainguard``'s hooks as Lightning calls them for one
  optimizer step (batch start, before the optimizer step, batch end), no gradient norm;
- ``hf``: ``trainguard.hf.Trainguard``'s hooks as the Hugging Face Trainer calls them;
- ``+ grad norm``: the loop and the Lightning callback each with a gradient norm over a
  small model's gradients (one fused norm per dtype, no host sync; the callback's default).

The trainer objects the hooks read (``global_step``, ``TrainerState``) are the frameworks'
own where they are cheap to make (the HF state and control) and a stand-in holding
``global_step`` for Lightning's, whose real Trainer is only reachable inside ``fit``.
Reported: the median over rounds of the mean per-step time, in µs, and each mode's
difference from the loop doing the same. The target: a callback costs at most 20 µs a step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from trainguard import Guard
from trainguard.runtime.embedded import EmbeddedControlPlane

STEPS, ROUNDS = 2000, 15


URL = ""


def live_guard() -> Guard:
    return Guard(job="bench-callbacks", rank=0, world_size=1, host="bench", nats_url=URL)


def small_model() -> nn.Module:
    model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(8)))
    model(torch.randn(4, 256)).sum().backward()  # type: ignore[no-untyped-call]
    return model


def loop_mode(grad_norm: bool) -> Callable[[int], None]:
    from trainguard.torch import grad_norm as norm

    guard = live_guard()
    loss = torch.tensor(1.0)
    model = small_model()

    def step(n: int) -> None:
        with guard.step(n) as s:
            with s.phase("compute"):
                pass
            with s.phase("optimizer"):
                pass
            s.report(loss=loss, grad_norm=norm(model) if grad_norm else None)
    return step


def lightning_mode(grad_norm: bool) -> Callable[[int], None]:
    import trainguard.lightning

    cb = trainguard.lightning.Trainguard(guard=live_guard(), root="/nonexistent",
                                         grad_norm=grad_norm)
    trainer: Any = SimpleNamespace(global_step=0)
    model: Any = small_model()
    out = {"loss": torch.tensor(1.0)}

    def step(n: int) -> None:
        trainer.global_step = n
        cb.on_train_batch_start(trainer, model, None, n)
        cb.on_before_optimizer_step(trainer, model, None)
        trainer.global_step = n + 1
        cb.on_train_batch_end(trainer, model, out, None, n)
    return step


def hf_mode() -> Callable[[int], None]:
    from transformers import TrainerControl, TrainerState, TrainingArguments

    import trainguard.hf

    cb = trainguard.hf.Trainguard(guard=live_guard(), root="/nonexistent", grad_norm=False)
    args = TrainingArguments(output_dir="/nonexistent/bench", report_to=[], use_cpu=True)
    state, control = TrainerState(), TrainerControl()
    model = small_model()

    def step(n: int) -> None:
        state.global_step = n
        cb.on_step_begin(args, state, control, model=model)
        cb.on_pre_optimizer_step(args, state, control, model=model)
        state.global_step = n + 1
        cb.on_step_end(args, state, control, model=model)
    return step


def per_step_us(step: Callable[[int], None], start: int) -> float:
    t0 = time.perf_counter()
    for n in range(start, start + STEPS):
        step(n)
    return (time.perf_counter() - t0) / STEPS * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write results as JSON here")
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp, EmbeddedControlPlane(tmp) as plane:
        global URL
        URL = plane.nats.url
        results = measure()
    print(f"{'mode':<24} {'µs/step':>8} {'vs loop':>8}")
    for name, us in results.items():
        base = results["loop + grad norm" if "grad norm" in name else "loop"]
        print(f"{name:<24} {us:>8.2f} {us - base:>+8.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"us_per_step": results, "steps": STEPS,
                                              "rounds": ROUNDS}, indent=2))
    return 0


def measure() -> dict[str, float]:
    modes = {"loop": loop_mode(False), "lightning": lightning_mode(False), "hf": hf_mode(),
             "loop + grad norm": loop_mode(True), "lightning + grad norm": lightning_mode(True)}
    samples: dict[str, list[float]] = {name: [] for name in modes}
    for r in range(ROUNDS):  # interleaved rounds: drift falls on every mode alike
        for name, step in modes.items():
            samples[name].append(per_step_us(step, r * STEPS))
    return {name: round(statistics.median(v), 2) for name, v in samples.items()}


if __name__ == "__main__":
    raise SystemExit(main())
