"""A small instrumented data-parallel trainer: the five lines of the README, for real.

Runs under torchrun (gloo on CPU) in the end-to-end tests, the demo and the benchmarks.
Each step is mostly a fixed sleep (``--step-time``) plus a small model's forward/backward,
so two busy cores do not turn a clean run into stragglers. ``--model lm`` trains a small
character-level transformer language model on a generated corpus; ``--model tiny`` an MLP.
Gradients are averaged with an explicit all-reduce in a ``comm`` phase, or by DDP with
``--ddp`` (timed by ``trainguard.torch.instrument_ddp``). With ``--ckpt-root`` it saves
through ``trainguard.torch.Checkpointer`` and resumes from ``ckpt.resume_point()``.
Batches depend only on (seed, rank, step), so a resumed run sees the same data.
For baselines without trainguard (``TRAINGUARD_DISABLED=1``): ``--raise-at``, ``--hang-at``,
``--nan-at`` and ``--slow`` inject faults, ``--progress-file`` records progress and
``--plain-ckpt`` checkpoints with plain ``torch.save``. ``--in-place`` forms the group with
``trainguard.torch.init_process_group`` and iterates ``guard.steps``, so a lost peer is
recovered in place; ``--final-params`` keeps rank 0's final parameters for comparisons.

    python -m torch.distributed.run --nproc-per-node 2 -m trainguard.examples.toy_trainer \
        --job demo --steps 200
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import trainguard
import trainguard.torch as tgt
from trainguard.contract import envnames


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", default=os.environ.get(envnames.JOB, "toy"))
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
    # Fault injection without trainguard's drills, for baselines (run them with
    # TRAINGUARD_DISABLED=1). Each fires on the first attempt only, like --raise-at.
    p.add_argument("--hang-at", metavar="RANK:STEP", default=None,
                   help="block RANK forever in the data phase of STEP (first attempt only)")
    p.add_argument("--nan-at", metavar="[RANK:]STEP", default=None,
                   help="fill the first parameter with NaN at STEP on RANK (every rank if "
                        "no RANK is given), first attempt only: the gradient all-reduce "
                        "spreads it, as the nan drill does")
    p.add_argument("--stop-at", metavar="RANK:STEP", default=None,
                   help="RANK stops itself with SIGSTOP at the start of STEP (first attempt "
                        "only), as the freeze drill does")
    p.add_argument("--ft-heartbeat", action="store_true",
                   help="send NVRx RankMonitorClient heartbeats every step (the rank runs "
                        "under NVRx's ft_launcher; nvidia-resiliency-ext must be installed)")
    p.add_argument("--slow", metavar="RANK:FACTOR", default=None,
                   help="RANK's compute phase takes FACTOR times as long (first attempt "
                        "only), as the slow drill does")
    p.add_argument("--slow-from", type=int, default=0, metavar="STEP",
                   help="--slow starts at this step (default 0)")
    p.add_argument("--progress-file", default=None, metavar="PATH",
                   help="rank 0 appends 'unix_time step attempt pid' per completed step; a "
                        "rank that fires an injected fault appends 'unix_time step attempt pid "
                        "fault=KIND rank=R'")
    p.add_argument("--plain-ckpt", default=None, metavar="DIR",
                   help="without trainguard: rank 0 saves model and optimizer with torch.save "
                        "every --ckpt-every steps to DIR/latest.pt, and every rank resumes "
                        "from it at start")
    p.add_argument("--in-place", action="store_true",
                   help="recover in place: trainguard.torch.init_process_group and "
                        "guard.steps (DDP through trainguard.torch.ddp)")
    p.add_argument("--rejoin-timeout", type=float, default=60.0,
                   help="with --in-place: seconds a survivor waits for the replacement")
    p.add_argument("--final-params", default=None, metavar="PATH",
                   help="rank 0 writes the final state_dict here with torch.save")
    return p.parse_args(argv)


def _rank_step(spec: str | None) -> tuple[int, int]:
    """``RANK:STEP`` -> (rank, step); None -> (-1, -1)."""
    if not spec:
        return -1, -1
    rank, _, step = spec.partition(":")
    return int(rank), int(step)


class ProgressFile:
    """``--progress-file``: one line per completed step (rank 0) or fired fault (any rank),
    appended with O_APPEND so several processes can share the file."""

    def __init__(self, path: str | None, rank: int, attempt: int) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) \
            if path else None
        self.rank, self.attempt = rank, attempt

    def _write(self, line: str) -> None:
        if self.fd is not None:
            os.write(self.fd, line.encode())

    def step(self, step: int, world: int) -> None:
        if self.rank == 0:
            self._write(f"{time.time():.6f} {step} {self.attempt} {os.getpid()} "
                        f"world={world}\n")

    def fault(self, step: int, kind: str) -> None:
        self._write(f"{time.time():.6f} {step} {self.attempt} {os.getpid()} fault={kind} "
                    f"rank={self.rank}\n")

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _ft_heartbeat() -> Callable[[], None]:
    """NVRx's rank heartbeat (``RankMonitorClient.send_heartbeat``), connected to the rank
    monitor that ``ft_launcher`` runs beside this rank. Imported by name: NVRx is a
    benchmark baseline, never a dependency of trainguard."""
    import importlib

    ft = importlib.import_module("nvidia_resiliency_ext.fault_tolerance")
    client = ft.RankMonitorClient()
    client.init_workload_monitoring()
    send: Callable[[], None] = client.send_heartbeat
    return send


def _plain_save(root: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    os.makedirs(root, exist_ok=True)
    tmp = os.path.join(root, f".latest.{os.getpid()}.tmp")
    torch.save({"step": step, "model": model.state_dict(),
                "optimizer": optimizer.state_dict()}, tmp)
    os.replace(tmp, os.path.join(root, "latest.pt"))


def _plain_load(root: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> int | None:
    path = os.path.join(root, "latest.pt")
    if not os.path.exists(path):
        return None
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


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
    guard = trainguard.Guard(job=args.job, heartbeat_interval=args.heartbeat,
                             fingerprint_every=args.fingerprint_every,
                             sync_every=args.sync_every, seed=args.seed,
                             checkpoint_every=args.ckpt_every if args.ckpt_root else None)
    if args.in_place:
        tgt.init_process_group(guard, "gloo", timeout=args.pg_timeout,
                               rejoin_timeout=args.rejoin_timeout)
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    # The start's rank keys the data and the faults: a rank renumbered in place (a host
    # before it left) keeps its stream; the world size is read at every step.
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    model: nn.Module = CharLM() if args.model == "lm" else TinyModel()
    text = corpus(args.seed) if args.model == "lm" else None
    if args.ddp and args.in_place:
        model = tgt.ddp(model, guard)  # rebuilt on the new group after an in-place re-form
    elif args.ddp:
        model = nn.parallel.DistributedDataParallel(model)
        tgt.instrument_ddp(model, guard)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    guard.attach(model, optimizer)
    ckpt = tgt.Checkpointer(guard, args.ckpt_root) if args.ckpt_root else None
    start = 0
    if ckpt is not None:
        point = ckpt.resume_point()  # one answer, shared by every rank
        if point is not None:
            start = ckpt.load(point, model, optimizer) + 1
            print(f"rank {rank}: resumed from step {point.step}", file=sys.stderr, flush=True)
    elif args.plain_ckpt:
        saved = _plain_load(args.plain_ckpt, model, optimizer)
        if saved is not None:
            start = saved + 1
            print(f"rank {rank}: resumed from step {saved} ({args.plain_ckpt})",
                  file=sys.stderr, flush=True)
    fail_rank, fail_step = (int(x) for x in args.raise_at.split(":")) if args.raise_at \
        else (-1, -1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    first_attempt = attempt == 0
    progress = ProgressFile(args.progress_file, rank, attempt)
    hang_rank, hang_step = _rank_step(args.hang_at)
    stop_rank, stop_step = _rank_step(args.stop_at)
    heartbeat = _ft_heartbeat() if args.ft_heartbeat else None
    if args.nan_at and ":" not in args.nan_at:
        nan_rank, nan_step = rank, int(args.nan_at)
    else:
        nan_rank, nan_step = _rank_step(args.nan_at)
    slow_rank, _, slow_factor = (args.slow or "-1:1").partition(":")
    slow = float(slow_factor) if int(slow_rank) == rank and first_attempt else 1.0
    for step in guard.steps(start, args.steps) if args.in_place else range(start, args.steps):
        if rank == fail_rank and step == fail_step and first_attempt:
            progress.fault(step, "crash")
            raise RuntimeError(args.raise_message)
        if rank == stop_rank and step == stop_step and first_attempt:
            progress.fault(step, "sigstop")
            os.kill(os.getpid(), signal.SIGSTOP)
        if rank == nan_rank and step == nan_step and first_attempt:
            progress.fault(step, "nan")
            tgt.poison_with_nan(model)
        if slow > 1.0 and step == args.slow_from:
            progress.fault(step, "slow")
        with guard.step(step) as s:
            with s.phase("data"):
                if rank == hang_rank and step == hang_step and first_attempt:
                    progress.fault(step, "hang")
                    while True:  # blocked for good: only a signal ends it
                        time.sleep(1.0)
                data = torch.Generator().manual_seed(args.seed * 1_000_003 + rank * 7919 + step)
                if text is not None:
                    at = torch.randint(0, len(text) - SEQ - 1, (8,), generator=data)
                    tokens = torch.stack([text[i:i + SEQ] for i in at.tolist()])
                    target = torch.stack([text[i + 1:i + SEQ + 1] for i in at.tolist()])
                else:
                    tokens = torch.randint(0, 64, (8, 16), generator=data)
                    target = torch.randint(0, 64, (8,), generator=data)
            with s.phase("compute"):
                t_compute = time.monotonic()
                time.sleep(args.step_time)
                out = model(tokens)
                loss = nn.functional.cross_entropy(out.reshape(-1, out.size(-1)),
                                                   target.reshape(-1))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()  # type: ignore[no-untyped-call]
                if slow > 1.0 and step >= args.slow_from:
                    time.sleep((time.monotonic() - t_compute) * (slow - 1.0))
            if not args.ddp:
                with s.phase("comm"):
                    world = dist.get_world_size()  # smaller once a host left in place
                    for p in model.parameters():
                        if p.grad is not None:
                            dist.all_reduce(p.grad)
                            p.grad /= world
            s.report(loss=loss.detach(), grad_norm=tgt.grad_norm(model), samples=8)
            optimizer.step()
        if guard.abandoned == step:
            continue  # a peer was lost: the next iteration recovers and runs it again
        progress.step(step, dist.get_world_size())
        if heartbeat is not None:
            heartbeat()
        if ckpt is not None and guard.should_checkpoint(step):
            ckpt.save(step, model, optimizer)
        elif args.plain_ckpt and rank == 0 and (step + 1) % args.ckpt_every == 0:
            _plain_save(args.plain_ckpt, step, model, optimizer)
    progress.close()
    if args.final_params and rank == 0:
        torch.save(model.state_dict(), args.final_params)
    if ckpt is not None:
        ckpt.close()
    guard.close()
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: finished {args.steps} steps", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
