"""A Hugging Face Trainer under trainguard: a tiny Llama built here (no tokenizer, nothing
downloaded) on synthetic token ids, DDP over gloo on CPU, the ``trainguard.hf`` callback.
docs/hf.md walks through it.

    trainguard launch --job hf --nproc-per-node 2 ... -m -- \\
        trainguard.examples.hf_trainer --root /ckpt --steps 200
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

import trainguard.hf

VOCAB, SEQ = 64, 16


def tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=32)
    return LlamaForCausalLM(config)


def synthetic(samples: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Token ids with a learnable pattern (each sequence counts up from a random start)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB, (samples, 1), generator=g)
    ids = (starts + torch.arange(SEQ)) % VOCAB
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


class StepTime(TrainerCallback):
    """A step long enough to be caught in (``--step-time``)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_begin(self, args: TrainingArguments, state: TrainerState,
                      control: TrainerControl, **kwargs: Any) -> None:
        time.sleep(self.seconds)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", default=os.environ.get("TRAINGUARD_JOB", "hf"))
    p.add_argument("--root", default=os.environ.get("TRAINGUARD_CHECKPOINT_ROOT", "checkpoints"),
                   help="checkpoint root, shared by every host")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--log-every", type=int, default=1,
                   help="HF's logging_steps: the loss is reported at these steps")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    guard = trainguard.hf.Trainguard(job=args.job, root=args.root,
                                     checkpoint_every=args.ckpt_every)
    training = TrainingArguments(
        output_dir=str(guard.run.job_dir), max_steps=args.steps, per_device_train_batch_size=4,
        learning_rate=1e-3, use_cpu=True, ddp_backend="gloo", report_to=[],
        save_strategy="no",  # trainguard decides when the Trainer saves
        logging_steps=args.log_every, logging_nan_inf_filter=False,  # a NaN is reported
        disable_tqdm=True, dataloader_num_workers=0, seed=0)
    callbacks: list[TrainerCallback] = [guard]
    if args.step_time:
        callbacks.append(StepTime(args.step_time))
    trainer = Trainer(model=tiny_llama(), args=training,
                      train_dataset=synthetic(4 * args.steps * world), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=guard.resume_path())


if __name__ == "__main__":
    main()
