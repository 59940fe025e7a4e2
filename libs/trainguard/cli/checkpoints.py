"""``trainguard checkpoints`` and ``trainguard save``: the coordinator's catalogue and save-now.

Both ask the checkpoint coordinator over NATS request/reply
(``<prefix>.<job>.rpc.checkpoints`` and ``<prefix>.<job>.rpc.save``), so they need only the
NATS URL, and they show what the coordinator itself decides from (its Redis layout stays
its own business).

    trainguard checkpoints --job llama-8b          # newest first; --json for tools
    trainguard save --job llama-8b --deadline 60   # exit 0: committed, 1: not, 2: error
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
from typing import Any

import msgspec
import nats.errors

from trainguard.contract.errors import DecodeError, TrainguardError
from trainguard.contract.rpc import (
    CATALOGUE,
    SAVE,
    CatalogueRequest,
    Endpoint,
    Rep,
    Req,
    SaveRequest,
    call,
)
from trainguard.contract.subjects import check_token
from trainguard.runtime.bus import connect_nats

from .common import add_connection_flags, settings_from


class CoordinatorUnavailable(TrainguardError):
    """No checkpoint coordinator answered the request."""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("checkpoints", help="list a job's checkpoints and its resume point",
                       description="List a job's checkpoints (newest first), the resume "
                                   "pointer, the pinned rollback target and the interval.")
    add_connection_flags(p)
    p.add_argument("--job", required=True, help="job name")
    p.add_argument("--json", action="store_true", help="print the coordinator's reply as JSON")
    p.add_argument("--limit", type=int, default=50, help="newest N checkpoints (default 50)")
    p.add_argument("--timeout", type=float, default=5.0,
                   help="seconds to wait for the coordinator (default 5)")
    p.set_defaults(run=run_checkpoints)

    q = sub.add_parser("save", help="checkpoint a job now and wait for the commit",
                       description="Ask every rank of a job to save now; wait for the commit "
                                   "up to --deadline. Exit 0 when a resume point was "
                                   "committed, 1 when not (the reason names the ranks that "
                                   "did not report), 2 on errors.")
    add_connection_flags(q)
    q.add_argument("--job", required=True, help="job name")
    q.add_argument("--deadline", type=float, default=120.0,
                   help="seconds to wait for the commit (default 120)")
    q.add_argument("--reason", default="requested from the command line")
    q.add_argument("--json", action="store_true", help="print the coordinator's reply as JSON")
    q.set_defaults(run=run_save)


async def _request(args: argparse.Namespace, endpoint: Endpoint[Req, Rep], req: Req,
                   timeout: float) -> dict[str, Any]:
    settings = settings_from(args)
    job = check_token("job", args.job)
    subject = endpoint.subject(settings.subjects, job)
    nc = await connect_nats(settings.nats_url, name="trainguard-cli",
                            timeout=settings.connect_timeout,
                            access=settings.access.nats_options())
    try:
        reply = await call(nc, settings.subjects, job, endpoint, req, timeout)
    except nats.errors.NoRespondersError:
        raise CoordinatorUnavailable(
            f"no checkpoint coordinator answers on {subject}; is `trainguard service "
            "checkpointer` (or `trainguard up`) running with the same prefix?") from None
    except (TimeoutError, nats.errors.TimeoutError):
        raise CoordinatorUnavailable(
            f"the checkpoint coordinator did not answer on {subject} within {timeout:g}s"
        ) from None
    except DecodeError as exc:
        raise CoordinatorUnavailable(f"unreadable reply on {subject}: {exc.reason}") from None
    finally:
        await nc.close()
    if reply is None:
        raise CoordinatorUnavailable(f"empty reply on {subject}")
    data: dict[str, Any] = msgspec.to_builtins(reply)
    return data


def run_checkpoints(args: argparse.Namespace) -> int:
    data = asyncio.run(_request(args, CATALOGUE, CatalogueRequest(limit=args.limit),
                                args.timeout))
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(format_catalogue(data))
    return 0


def run_save(args: argparse.Namespace) -> int:
    req = SaveRequest(deadline=args.deadline, reason=args.reason)
    data = asyncio.run(_request(args, SAVE, req, args.deadline + 10.0))
    if args.json:
        print(json.dumps(data, indent=2))
    elif data.get("ok"):
        print(f"committed step {data.get('step')} at {data.get('path')} "
              f"in {data.get('elapsed', 0.0):.1f}s")
    else:
        missing = data.get("missing_ranks") or []
        failed = data.get("failed_ranks") or []
        print(f"not saved ({data.get('status')}): {data.get('reason')}")
        if missing:
            print(f"ranks that did not report: {missing}")
        if failed:
            print(f"ranks that failed: {failed}")
    return 0 if data.get("ok") else 1


def _when(ts: Any) -> str:
    if not ts:
        return "-"
    return dt.datetime.fromtimestamp(float(ts)).strftime("%H:%M:%S")


def _size(n: Any) -> str:
    value = float(n or 0)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1024 or unit == "GB":
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return f"{value:.1f}TB"


def _layout(topology: Any) -> str:
    """``sharded over shard (mesh shard=4)``: what a load at another size reshards from."""
    if not isinstance(topology, dict) or not topology.get("mesh_shape"):
        return ""
    mesh = " x ".join(f"{n}={s}" for n, s in zip(topology.get("mesh_dims") or [],
                                                 topology["mesh_shape"], strict=False))
    return f"{topology.get('kind', '')} over {','.join(topology.get('sharded_dims') or [])} " \
           f"(mesh {mesh})"


def _age(seconds: Any) -> str:
    s = float(seconds or 0)
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.1f}h"


Row = tuple[str, str, str, str, str, str, str, str, str]


def _memory_row(m: dict[str, Any]) -> Row:
    """The ranks' memory snapshots as one row: the newest step every rank holds (taken
    when CLOSED says), the host memory (SIZE) and copy cost (BLOCKED) of the heaviest rank
    per rank, and the oldest step kept."""
    ranks = m.get("ranks") or []
    world = m.get("world_size") or "?"
    copy, check = float(m.get("copy_seconds") or 0), float(m.get("check_seconds") or 0)
    note = (f"newest {_age(m.get('age'))} old; oldest kept {m.get('oldest_step')} "
            f"({_age(m.get('oldest_age'))} old); every {m.get('every')} step(s); size and "
            "blocked per rank")
    if int(m.get("buddy_step", -1)) >= 0:
        note += (f"; buddies hold {m.get('buddy_step')} "
                 f"({_size(m.get('buddy_bytes'))} per rank)")
    return (str(m.get("newest_step")), "held", "memory", f"{len(ranks)}/{world}",
            _size(m.get("host_bytes")), f"{copy:.3f}s", f"{copy + check:.3f}s",
            _when(m.get("taken")), note)


def format_catalogue(data: dict[str, Any]) -> str:
    """The catalogue as a table a person reads on a terminal."""
    lines = [f"job {data.get('job')}"]
    pointer = data.get("pointer")
    lines.append(f"resume point: step {pointer['step']} ({pointer['path']})" if pointer
                 else "resume point: none")
    if data.get("pin") is not None:
        lines.append(f"pinned by rollback: step {data['pin']}")
    interval = data.get("interval")
    if interval:
        lines.append(f"interval: every {interval.get('every_steps')} steps "
                     f"(~{float(interval.get('seconds') or 0):.0f}s; save cost "
                     f"{float(interval.get('cost') or 0):.2f}s, MTBF "
                     f"{float(interval.get('mtbf') or 0) / 3600:.1f}h)")
    for anomaly, onset in (data.get("onsets") or {}).items():
        lines.append(f"open onset: {onset.get('kind')} at step {onset.get('step')} "
                     f"(anomaly {anomaly})")
    rows: list[Row] = [("STEP", "STATUS", "KIND", "RANKS", "SIZE", "BLOCKED", "TOTAL", "CLOSED",
                        "NOTE")]
    memory = data.get("memory")
    if memory:
        rows.append(_memory_row(memory))
    for c in data.get("checkpoints") or []:
        reported = len(c.get("reported") or [])
        note = c.get("suspect") or c.get("reason") or _layout(c.get("topology"))
        if c.get("missing_ranks") and c.get("status") in ("failed", "pending"):
            note = f"missing {c['missing_ranks']}" + (f"; {note}" if note else "")
        kind = "full" if c.get("base") is None else f"incr of {c['base']}"
        rows.append((str(c.get("step")), str(c.get("status")), kind,
                     f"{reported}/{c.get('world_size')}", _size(c.get("bytes")),
                     f"{float(c.get('seconds_blocked') or 0):.2f}s",
                     f"{float(c.get('seconds_total') or 0):.2f}s", _when(c.get("closed_at")),
                     note[:80]))
    if len(rows) == 1:
        lines.append("no checkpoints")
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        lines.append("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=False)) + "  " + r[-1])
    return "\n".join(lines)
