"""``trainguard runs``: the run record stored with a job's checkpoints, and what changed.

    trainguard runs show llama-8b [--root /ckpt] [--step 4000] [--json] [--packages]
    trainguard runs diff llama-8b@3000 llama-8b@4000     # or paths to run.json / step dirs

Both read ``<root>/<job>/step-<S>/run.json`` (the root: ``--root`` or
``TRAINGUARD_CHECKPOINT_ROOT``). ``diff`` prints only the keys that differ and exits 1 when
any do, like ``diff``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from typing import Any


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("runs", help="show a job's run record, or diff two",
                       description="The run record (code, packages, hardware, environment, "
                                   "seeds, data manifest, config) stored with each checkpoint.")
    commands = p.add_subparsers(dest="runs_command", metavar="COMMAND", required=True)
    s = commands.add_parser("show", help="the run record of a job's newest (or given) checkpoint")
    s.add_argument("job", metavar="JOB", help="job name, JOB@STEP, or a path to a run.json or "
                                              "checkpoint directory")
    s.add_argument("--root", help="checkpoint root (default: TRAINGUARD_CHECKPOINT_ROOT)")
    s.add_argument("--step", type=int, help="that checkpoint's record (default: the newest)")
    s.add_argument("--json", action="store_true", help="print the record as stored")
    s.add_argument("--packages", action="store_true", help="list every installed package")
    s.set_defaults(run=run_show)
    d = commands.add_parser("diff", help="what differs between two run records",
                            description="Print the keys whose values differ between two run "
                                        "records; exit 0 when none do, 1 when some do.")
    d.add_argument("a", metavar="A", help="JOB[@STEP] or a path to a run.json / checkpoint dir")
    d.add_argument("b", metavar="B", help="the same, for the other side")
    d.add_argument("--root", help="checkpoint root (default: TRAINGUARD_CHECKPOINT_ROOT)")
    d.add_argument("--json", action="store_true", help="print [key, a, b] rows as JSON")
    d.set_defaults(run=run_diff)


def run_show(args: argparse.Namespace) -> int:
    from trainguard.contract.runrecord import encode_run_record
    from trainguard.runs.locate import checkpoint_root, find_record, resolve
    from trainguard.runs.record import read_run_record

    if args.step is not None:
        path = find_record(checkpoint_root(args.root), args.job, args.step)
    else:
        path = resolve(args.job, args.root)
    record = read_run_record(path)
    if args.json:
        print(encode_run_record(record).decode(), end="")
        return 0
    print(f"run record {path}")
    print(format_record(record, packages=args.packages))
    return 0


def run_diff(args: argparse.Namespace) -> int:
    from trainguard.runs.diff import diff_records
    from trainguard.runs.locate import resolve
    from trainguard.runs.record import read_run_record

    pa, pb = resolve(args.a, args.root), resolve(args.b, args.root)
    rows = diff_records(read_run_record(pa), read_run_record(pb))
    if args.json:
        print(json.dumps([list(r) for r in rows], indent=1))
        return 1 if rows else 0
    print(f"--- {pa}\n+++ {pb}")
    if not rows:
        print("no differences")
        return 0
    for key, a, b in rows:
        print(f"{key}: {_show(a)} -> {_show(b)}")
    return 1


def _show(value: Any) -> str:
    return "(absent)" if value is None else json.dumps(value) if not isinstance(value, str) \
        else repr(value)


def format_record(record: Any, *, packages: bool = False) -> str:
    """A run record as a person reads it on a terminal."""
    from trainguard.runs.diff import flatten

    git, hw, env = record.git, record.hardware, record.environment
    when = dt.datetime.fromtimestamp(record.created_at).isoformat(timespec="seconds")
    if git.error:
        code = f"unknown ({git.error})"
    else:
        code = git.revision + (f" ({git.branch})" if git.branch else "") + (
            f" DIRTY, diff sha256 {git.diff_sha256[:16]}" if git.dirty else " clean")
    gpus = ", ".join(hw.gpus) if hw.gpus else "none seen"
    lines = [
        f"job      {record.job or '-'}   host {record.host}   written {when}",
        f"code     {code}",
        f"data     {record.manifest_id or '-'}"
        + (f" ({record.manifest_path})" if record.manifest_path else ""),
        f"seeds    {', '.join(f'{k}={v}' for k, v in record.seeds.items()) or '-'}",
        f"python   {env.get('python', '?')} on {env.get('platform', '?')}",
        f"argv     {env.get('argv', '')}",
        f"cpu      {hw.cpu_model} x {hw.cpu_count}, {hw.memory_bytes / 2**30:.0f} GiB",
        f"gpu      {gpus}; driver {hw.driver or '-'}, CUDA {hw.cuda or '-'}, "
        f"NCCL {hw.nccl or '-'}, torch {hw.torch or '-'}",
    ]
    config = flatten(record.config)
    if record.config:
        lines.append("config")
        lines += [f"  {k} = {json.dumps(v)}" for k, v in sorted(config.items())]
    if record.env:
        lines.append("env")
        lines += [f"  {k}={v}" for k, v in record.env.items()]
    if packages:
        lines.append("packages")
        lines += [f"  {k}=={v}" for k, v in record.packages.items()]
    else:
        lines.append(f"packages {len(record.packages)} installed (--packages lists them)")
    return "\n".join(lines)
