"""A small instrumented data-parallel trainer: the five lines of the README, for real.

Runs under torchrun (gloo on CPU) in the end-to-end tests, the demo and the benchmarks.
Each step is mostly a fixed sleep (``--step-time``) plus a small model's forward/backward,
so two busy cores do not turn a clean run into stragglers. ``--model lm`` trains a small
character-level transformer language model on a generated corpus; ``--model tiny`` an MLP.
Gradients are averaged with an explicit all-reduce in a ``comm`` phase, or by DDP with
``--ddp`` (timed by ``trainguard.torch.instrument_ddp``). ``--parallel fsdp`` shards the
model with FSDP2 (``fully_shard`` on each transformer block or layer, then on the root) on
a 1-D mesh over every rank, ``--parallel hsdp`` on a 2-D ``(replicate, shard)`` mesh of
shape (world/2, 2); FSDP reduces the gradients itself (no ``comm`` phase) and
``--optimizer adamw`` keeps sharded optimizer state. With ``--ckpt-root`` it saves
through ``trainguard.torch.Checkpointer`` and resumes with ``ckpt.resume(...)``.
Batches depend only on (seed, rank, step), so a resumed run sees the same data.
For baselines without trainguard (``TRAINGUARD_DISABLED=1``): ``--raise-at``, ``--hang-at``,
``--nan-at`` and ``--slow`` inject faults, ``--progress-file`` records progress and
``--plain-ckpt`` checkpoints with plain ``torch.save`` (sharded: DCP, as a user of FSDP
would). ``--in-place`` forms the group with ``trainguard.torch.init_process_group`` and
iterates ``guard.steps``, so a lost peer is recovered in place; ``--final-params`` keeps the
final parameters (sharded: the gathered full state dict) for comparisons.

    python -m torch.distributed.run --nproc-per-node 2 -m trainguard.examples.toy_trainer \
        --job demo --steps 200
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import math
import os
import random
import shutil
import signal
import sys
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import trainguard
import trainguard.torch as tgt
from trainguard.contract import envnames

from .samples import stateful_loader, weighted_loss

PARALLEL = ("dp", "fsdp", "hsdp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", default=os.environ.get(envnames.JOB, "toy"))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--step-time", type=float, default=0.02,
                   help="seconds of simulated compute per step (default 0.02)")
    # Irregular steps, as real jobs have them (none by default).
    p.add_argument("--jitter", type=float, default=0.0, metavar="SIGMA",
                   help="log-normal sigma of each rank's --step-time sleep, per step")
    p.add_argument("--eval-every", type=int, default=0, metavar="N",
                   help="every N steps every rank evaluates first (phase eval)")
    p.add_argument("--eval-seconds", type=float, default=5.0,
                   help="how long an evaluation takes (default 5)")
    p.add_argument("--refill-every", type=int, default=0, metavar="N",
                   help="about every N steps (seeded) the data loaders refill")
    p.add_argument("--refill-seconds", type=float, default=1.0,
                   help="the longest refill; each takes 20-100%% of it (default 1), reading "
                        "and decoding as a loader does")
    p.add_argument("--refill-alone", action="store_true",
                   help="a refill is one rank's (in turn), its peers waiting for it")
    p.add_argument("--first-step-seconds", type=float, default=0.0,
                   help="each process's first step computes this much longer (compiling)")
    p.add_argument("--ddp", action="store_true", help="average gradients with DDP")
    p.add_argument("--parallel", choices=PARALLEL, default="dp",
                   help="dp: replicated model, gradients all-reduced (default); fsdp: FSDP2 "
                        "fully_shard on a 1-D mesh over every rank; hsdp: FSDP2 on a 2-D "
                        "(replicate, shard) mesh of shape (world/2, 2), an even world size")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd",
                   help="sgd (lr 0.05, default) or adamw (lr 1e-3; sharded state under FSDP)")
    p.add_argument("--model", choices=("tiny", "lm"), default="tiny")
    p.add_argument("--ckpt-root", help="save checkpoints here and resume from them")
    p.add_argument("--memory-snapshots", default="auto", type=_memory_every,
                   help="memory snapshots every N steps, 'auto' (from their measured cost) "
                        "or 'off': the tier a rollback in place takes before the disk")
    p.add_argument("--buddy", action="store_true",
                   help="copy each memory snapshot to a buddy rank on another host "
                        "(Checkpointer(buddy=True)): a lost FSDP rank's shard comes back "
                        "from memory in place")
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
                   help="block RANK forever in the --hang-phase of STEP (first attempt only)")
    p.add_argument("--hang-phase", choices=("data", "compute"), default="data",
                   help="where --hang-at blocks: waiting for data (default) or in compute "
                        "(a kernel or a lock that never returns)")
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
                        "from it at start; sharded (--parallel fsdp/hsdp): every rank saves "
                        "with DCP to DIR/step-<S>/, rank 0 then names it in DIR/latest, and "
                        "every rank resumes from the step named there")
    p.add_argument("--in-place", action="store_true",
                   help="recover in place: trainguard.torch.init_process_group and "
                        "guard.steps (DDP through trainguard.torch.ddp)")
    p.add_argument("--rejoin-timeout", type=float, default=60.0,
                   help="with --in-place: seconds a survivor waits for the replacement")
    p.add_argument("--final-params", default=None, metavar="PATH",
                   help="rank 0 writes the final state_dict here with torch.save (sharded: "
                        "the full state dict, gathered by every rank)")
    p.add_argument("--loader", choices=("step", "stateful"), default="step",
                   help="step: batches keyed by (seed, rank, step); stateful: numbered samples "
                        "through a StatefulDataLoader read with trainguard.torch.Batches, each "
                        "batch checked by trainguard.torch.BatchCheck (the tiny model only)")
    p.add_argument("--samples-file", default=None, metavar="PATH",
                   help="with --loader stateful: a line per step a rank completes: rank, "
                        "step, attempt, pid, loss and the sample ids it trained on")
    p.add_argument("--bad-batch-at", metavar="RANK:STEP", default=None,
                   help="with --loader stateful: a NaN loss weight in that rank's batch")
    p.add_argument("--exclude-step", type=int, default=None, metavar="STEP",
                   help="with --loader stateful: every rank reads that step's batch and "
                        "makes no update from it (the run a skipped bad batch should equal)")
    p.add_argument("--manifest", default=None,
                   help="the data's manifest: checked at resume (Checkpointer(manifest=))")
    args = p.parse_args(argv)
    if args.loader == "stateful" and args.model != "tiny":
        p.error("--loader stateful feeds the tiny model")
    if args.ddp and args.parallel != "dp":
        p.error(f"--ddp replicates the model: it does not go with --parallel {args.parallel}")
    return args


@dataclasses.dataclass(frozen=True)
class Irregular:
    """One step's irregular parts (``--jitter``, ``--eval-every``, ``--refill-every``):
    seeded by the step, so every rank agrees on an evaluation's or a refill's length."""

    jitter: float = 1.0
    eval_s: float = 0.0
    refill_s: float = 0.0

    @classmethod
    def of(cls, args: argparse.Namespace, step: int, rank: int, world: int) -> Irregular:
        job = random.Random(args.seed * 1_000_003 + step)
        mine = random.Random((args.seed * 1_000_003 + step) * 7919 + rank)
        jitter = math.exp(mine.gauss(0.0, args.jitter)) if args.jitter > 0 else 1.0
        evaluates = args.eval_every > 0 and step > 0 and step % args.eval_every == 0
        refill = 0.0
        if args.refill_every > 0 and step > 0 and job.random() < 1.0 / args.refill_every:
            alone = step % world if args.refill_alone else rank
            refill = args.refill_seconds * job.uniform(0.2, 1.0) if alone == rank else 0.0
        return cls(jitter, args.eval_seconds if evaluates else 0.0, refill)


def refill(seconds: float) -> None:
    """A loader refilling for ``seconds``: it reads and decodes (hashes) file bytes, working
    the whole time as a real refill does; a stuck loader, which waits, is the ``hang``."""
    deadline = time.monotonic() + seconds
    with open(__file__, "rb") as f:
        while time.monotonic() < deadline:
            f.seek(0)
            hashlib.sha256(f.read()).digest()


def _memory_every(value: str) -> int | str | None:
    if value in ("auto", "off"):
        return None if value == "off" else value
    if value.isdigit() and int(value) >= 1:
        return int(value)
    raise argparse.ArgumentTypeError(f"{value!r}: give a number of steps >= 1, 'auto' or 'off'")


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


LATEST = "latest"
"""``--plain-ckpt`` with a sharded model: the file in DIR that names the last complete
``step-<S>`` directory (written by rank 0 once DCP's save returned on it)."""


def _dcp_save(root: str, step: int, model: nn.Module,
              optimizer: torch.optim.Optimizer) -> None:
    """Collective: every rank writes its shards of model and optimizer to
    ``root/step-<step>/``; rank 0 then names that directory in ``root/latest`` (atomically)
    and drops the directories before the previous one."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save

    name = f"step-{step}"
    model_sd, optim_sd = get_state_dict(model, optimizer)
    save({"model": model_sd, "optim": optim_sd, "meta": {"step": step}},
         checkpoint_id=os.path.join(root, name))
    if dist.get_rank() != 0:
        return
    # DCP's save returns on rank 0 only after every rank wrote and the metadata is in place.
    previous = _latest(root)
    tmp = os.path.join(root, f".{LATEST}.{os.getpid()}.tmp")
    with open(tmp, "w") as fh:
        fh.write(name + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, os.path.join(root, LATEST))
    keep = {name, previous}
    for entry in os.listdir(root):
        if entry.startswith("step-") and entry not in keep:
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)


def _latest(root: str) -> str | None:
    try:
        with open(os.path.join(root, LATEST)) as fh:
            return fh.read().strip() or None
    except FileNotFoundError:
        return None


def _dcp_load(root: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> int | None:
    """Collective: the step directory named in ``root/latest`` into model and optimizer
    (DCP reshards); returns its step, None when there is none yet. Rank 0 reads the name
    and every rank loads that one."""
    box: list[Any] = [_latest(root) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    name: str | None = box[0]
    if name is None:
        return None
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd, "meta": {"step": -1}}
    load(state, checkpoint_id=os.path.join(root, name))  # the step comes back in its place
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    return int(state["meta"]["step"])


def mesh_of(parallel: str, world: int) -> Any:
    """``fsdp``: a 1-D mesh over every rank; ``hsdp``: a 2-D ``(replicate, shard)`` mesh of
    shape (world/2, 2), replicas of 2-rank shard groups."""
    from torch.distributed.device_mesh import init_device_mesh

    if parallel == "hsdp":
        if world % 2:
            raise SystemExit(f"--parallel hsdp shards over pairs of ranks: the world size "
                             f"must be even, not {world}")
        return init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))


def shard(model: nn.Module, mesh: Any) -> nn.Module:
    """FSDP2: ``fully_shard`` on each transformer block (each layer of the tiny model), then
    on the root."""
    from torch.distributed.fsdp import fully_shard

    # The tiny model's layers return views (3-D inputs); nothing here changes one in place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view")
    if isinstance(model, CharLM):
        layers: list[nn.Module] = list(model.blocks.layers)
    else:
        layers = [m for m in model.modules()
                  if m is not model and isinstance(m, nn.Linear | nn.Embedding)]
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_params(model: nn.Module) -> dict[str, Any]:
    """A sharded model's full state dict, gathered to rank 0's CPU (empty on the others).
    Collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))


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


def forward_backward(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor,
                     target: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """The step's forward and backward; returns the loss, detached. In a function of its own
    so that the autograd graph dies with its frame: a failed backward's graph holds FSDP2's
    process groups, which an in-place recovery must be able to close."""
    out = model(tokens)
    loss = weighted_loss(out, target, weight) if weight is not None else \
        nn.functional.cross_entropy(out.reshape(-1, out.size(-1)), target.reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]
    return loss.detach()


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
    if args.loader == "stateful":  # the runs whose loss curves are compared bit for bit
        tgt.seed_everything(args.seed, deterministic=True)
    else:
        torch.manual_seed(args.seed)
    make: Callable[[], nn.Module] = CharLM if args.model == "lm" else TinyModel
    text = corpus(args.seed) if args.model == "lm" else None
    sharded = args.parallel != "dp"
    model: nn.Module
    if sharded and args.in_place:
        # Built again on the new mesh after an in-place re-form (HSDP: a lost shard comes
        # from its replica).
        # The mesh is sized by the group as it is then: a resize in place changes it.
        model = tgt.fsdp(lambda mesh: shard(make(), mesh), guard,
                         mesh=lambda: mesh_of(args.parallel, dist.get_world_size()))
    elif sharded:
        model = shard(make(), mesh_of(args.parallel, dist.get_world_size()))
    elif args.ddp and args.in_place:
        model = tgt.ddp(make(), guard)  # rebuilt on the new group after an in-place re-form
    elif args.ddp:
        model = nn.parallel.DistributedDataParallel(make())
        tgt.instrument_ddp(model, guard)
    else:
        model = make()
    # After sharding: the optimizer holds (and AdamW's state is) the DTensor shards.
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3) \
        if args.optimizer == "adamw" else torch.optim.SGD(model.parameters(), lr=0.05)
    guard.attach(model, optimizer)
    # Before the Checkpointer, on every rank alike (a replacement builds them in this order).
    batches = tgt.Batches(stateful_loader(args.seed, dist.get_world_size(), rank), guard) \
        if args.loader == "stateful" else None
    check = tgt.BatchCheck(guard) if batches is not None else None
    ckpt = tgt.Checkpointer(guard, args.ckpt_root, memory=args.memory_snapshots, data=batches,
                            manifest=args.manifest, buddy=args.buddy or None,
                            run_config={k: v for k, v in vars(args).items()
                                        if isinstance(v, (int, float, str, bool))}) \
        if args.ckpt_root else None
    start = 0
    if ckpt is not None:
        start = ckpt.resume(model, optimizer)  # the newest committed checkpoint that loads
        if start > 0:
            print(f"rank {rank}: resumed from step {start - 1}", file=sys.stderr, flush=True)
    elif args.plain_ckpt:
        saved = _dcp_load(args.plain_ckpt, model, optimizer) if sharded \
            else _plain_load(args.plain_ckpt, model, optimizer)
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
    bad_rank, bad_step = _rank_step(args.bad_batch_at)
    samples_fd = os.open(args.samples_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) \
        if args.samples_file else None
    slow_rank, _, slow_factor = (args.slow or "-1:1").partition(":")
    slow = float(slow_factor) if int(slow_rank) == rank and first_attempt else 1.0
    first_step = args.first_step_seconds
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
            nan_rank = -1  # a transient fault: a rollback in place runs the step clean
        if slow > 1.0 and step == args.slow_from:
            progress.fault(step, "slow")
        with guard.step(step) as s:
            if rank == hang_rank and step == hang_step and first_attempt:
                progress.fault(step, "hang")
                with s.phase(args.hang_phase):
                    while True:  # blocked for good: only a signal ends it
                        time.sleep(1.0)
            irregular = Irregular.of(args, step, rank, dist.get_world_size())
            if irregular.eval_s:
                with s.phase("eval"):
                    time.sleep(irregular.eval_s)
            weight = ids = None
            with s.phase("data"):
                refill(irregular.refill_s)
                data = torch.Generator().manual_seed(args.seed * 1_000_003 + rank * 7919 + step)
                if batches is not None and check is not None:
                    batch = batches.next(step)
                    if rank == bad_rank and step == bad_step and first_attempt:
                        progress.fault(step, "bad_batch")
                        batch["weight"][3] = float("nan")
                    batch = check(s, batch, ids=batch["id"], source="numbered-samples")
                    tokens, target, weight = batch["tokens"], batch["target"], batch["weight"]
                    ids = batch["id"].tolist()
                elif text is not None:
                    at = torch.randint(0, len(text) - SEQ - 1, (8,), generator=data)
                    tokens = torch.stack([text[i:i + SEQ] for i in at.tolist()])
                    target = torch.stack([text[i + 1:i + SEQ + 1] for i in at.tolist()])
                else:
                    tokens = torch.randint(0, 64, (8, 16), generator=data)
                    target = torch.randint(0, 64, (8,), generator=data)
            if step == args.exclude_step:
                continue  # read, not trained on: what a skipped bad batch leaves
            with s.phase("compute"):
                t_compute = time.monotonic()
                time.sleep(args.step_time * irregular.jitter + first_step)
                first_step = 0.0
                loss = forward_backward(model, optimizer, tokens, target, weight)
                if slow > 1.0 and step >= args.slow_from:
                    time.sleep((time.monotonic() - t_compute) * (slow - 1.0))
            if not args.ddp and not sharded:  # FSDP reduced the gradients in backward
                with s.phase("comm"):
                    world = dist.get_world_size()  # smaller once a host left in place
                    for p in model.parameters():
                        if p.grad is not None:
                            dist.all_reduce(p.grad)
                            p.grad /= world
            s.report(loss=loss, grad_norm=tgt.grad_norm(model), samples=8)
            optimizer.step()
        if guard.abandoned == step:
            continue  # a peer was lost: the next iteration recovers and runs it again
        if samples_fd is not None:
            trained = "skipped" if s.skipped else f"{float(loss):.17g}"
            os.write(samples_fd, f"{rank} {step} {attempt} {os.getpid()} {trained} "
                                 f"{','.join(map(str, ids or []))}\n".encode())
        progress.step(step, dist.get_world_size())
        if heartbeat is not None:
            heartbeat()
        if ckpt is not None and guard.should_checkpoint(step):
            ckpt.save(step, model, optimizer)
        elif args.plain_ckpt and (step + 1) % args.ckpt_every == 0:
            if sharded:  # collective
                _dcp_save(args.plain_ckpt, step, model, optimizer)
            elif rank == 0:
                _plain_save(args.plain_ckpt, step, model, optimizer)
    progress.close()
    if samples_fd is not None:
        os.close(samples_fd)
    if args.final_params and sharded:
        full = full_params(model)  # collective
        if dist.get_rank() == 0:
            torch.save(full, args.final_params)
    elif args.final_params and rank == 0:
        torch.save(model.state_dict(), args.final_params)
    if ckpt is not None:
        ckpt.close()
    guard.close()
    dist.barrier()
    # FSDP2's modules hold their mesh's groups: let them go while the groups still exist
    # (seen once at exit otherwise: "terminate called without an active exception").
    guard.attach(None)
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()
    print(f"rank {rank}: finished {args.steps} steps", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
