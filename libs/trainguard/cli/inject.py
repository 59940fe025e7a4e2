"""``trainguard inject``: fault drills from the command line, acknowledged.

    trainguard inject --job J --rank R FAULT [ARGS]     # hang, slow F, nan, crash, sdc,
                                                        # kill, freeze, thaw, dump
    trainguard inject --job J --host H FAULT [ARGS]     # ecc, xid N, throttle, kill ...

Rank-side drills go to the rank (``cmd.rank.R``); agent-side ones to the rank's host
(``cmd.host.H``, found from the rank's registration). Refused unless the job was launched
with drills allowed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from typing import Any

from trainguard.contract.codec import decode_durable
from trainguard.contract.errors import ConfigError, DecodeError
from trainguard.contract.schemas import AGENT_DRILLS, RANK_DRILLS, CommandAck, NodeHello, RankHello
from trainguard.contract.subjects import stream_name
from trainguard.contract.targets import addressed, for_agent
from trainguard.core.connection import flush
from trainguard.runtime.bus import Bus, connect_nats

from .common import add_connection_flags, settings_from

DRILLS = RANK_DRILLS | AGENT_DRILLS | {"dump"}


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("inject", help="inject a fault drill into a running job",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", required=True)
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--rank", type=int)
    target.add_argument("--host")
    p.add_argument("fault", choices=sorted(DRILLS))
    p.add_argument("args", nargs="*", help="slow FACTOR | xid CODE | hang SECONDS | "
                                           "crash MESSAGE | ecc COUNT | throttle REASON")
    p.add_argument("--timeout", type=float, default=15.0, help="seconds to wait for the ack")
    add_connection_flags(p)
    p.set_defaults(run=run)


def params_for(fault: str, args: list[str]) -> dict[str, Any]:
    """Positional drill arguments as command params; a bad one is a ConfigError."""
    try:
        if fault == "slow":
            return {"factor": float(args[0]) if args else 2.0}
        if fault == "xid":
            return {"code": int(args[0]) if args else 79}
        if fault == "hang":
            return {"seconds": float(args[0])} if args else {}
        if fault == "ecc":
            return {"count": int(args[0]) if args else 1}
    except ValueError:
        raise ConfigError(f"{fault}: {args[0]!r} is not a number") from None
    if fault == "crash" and args:
        return {"message": " ".join(args)}
    if fault == "throttle" and args:
        return {"reasons": args}
    if args:
        raise ConfigError(f"{fault} takes no arguments (got {' '.join(args)})")
    return {}


async def _last(bus: Bus, prefix: str, subject: str) -> bytes | None:
    try:
        msg = await bus.js.get_last_msg(stream_name(prefix, "reports"), subject)
    except Exception:
        return None
    return bytes(msg.data) if msg.data else None


async def _inject(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    s = settings.subjects
    nc = await connect_nats(settings.nats_url, name="trainguard-cli",
                            timeout=settings.connect_timeout,
                            access=settings.access.nats_options())
    bus = Bus(nc, s, source="trainguard/cli")
    try:
        host = args.host
        drills_allowed: bool | None = None
        if args.rank is not None:
            raw = await _last(bus, settings.prefix, s.reg_rank(args.job, args.rank))
            if raw is None:
                raise ConfigError(f"no rank {args.rank} registered for job {args.job!r}; "
                                  "is the job running with trainguard.Guard?")
            hello = decode_durable(raw, RankHello)
            host = hello.host
            drills_allowed = hello.env.get("drills") == "1"
        raw = await _last(bus, settings.prefix, s.reg_node(args.job, host))
        if raw is not None:
            with contextlib.suppress(DecodeError):
                drills_allowed = decode_durable(raw, NodeHello).drills_allowed
        if for_agent(args.fault) and raw is None:
            raise ConfigError(f"no agent registered for host {host!r} of job {args.job!r}; "
                              "agent-side drills need `trainguard launch`")
        if drills_allowed is False and args.fault != "dump":
            raise ConfigError(f"job {args.job!r} was not launched with drills allowed; "
                              "relaunch with `trainguard launch --allow-drills`")
        subject, cmd = addressed(s, args.job, args.fault, params_for(args.fault, list(args.args)),
                                 issuer="cli", rank=args.rank, host=host)
        acks: asyncio.Queue[CommandAck] = asyncio.Queue()

        async def on_ack(msg: Any) -> None:
            ack = decode_durable(msg.data, CommandAck)
            if ack.command_id == cmd.id:
                await acks.put(ack)

        await nc.subscribe(s.ack(args.job, "cli"), cb=on_ack)
        await flush(nc)
        await bus.publish_durable(subject, cmd)
        try:
            ack = await asyncio.wait_for(acks.get(), args.timeout)
        except TimeoutError:
            print(f"{args.fault} sent to {subject} (command {cmd.id}); no ack within "
                  f"{args.timeout:.0f}s")
            return 1
        print(f"{args.fault} -> {ack.responder}: {ack.outcome}"
              f"{': ' + ack.detail if ack.detail else ''}")
        return 0 if ack.outcome == "done" else 1
    finally:
        await bus.close()


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_inject(args))
