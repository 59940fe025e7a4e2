"""``trainguard unblock HOST``: end a host's blocklist entry before its TTL.

The entry is ended, not deleted: its ``expires`` becomes now and ``released_by`` says who,
so agents let the host join at once, and the leading remediator removes the entry on its
next sweep and runs its ``release_hook`` (uncordon the node, resume the Slurm node). It
needs no running service, and a remediator that re-isolates the host meanwhile wins (the
write is optimistic: ``WATCH``, then the entry as read). It takes a role whose Redis user
may write the blocklist: ``operator`` (a person's break-glass role) or the remediator's.

    trainguard unblock node-b --credentials ~/.trainguard/operator.json
    exit 0: ended; 1: the host was not blocklisted; 2: error
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import time

from trainguard.contract.subjects import check_token
from trainguard.runtime.state import Keys, encode_blocklist_entry, read_blocklist_entry

from . import extras
from .common import add_connection_flags, settings_from


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("unblock", help="end a host's blocklist entry (it may rejoin jobs)",
                       description="End HOST's blocklist entry now: agents let it join again "
                                   "at once; the remediator removes the entry and runs its "
                                   "release hook. Exit 0: ended, 1: not blocklisted, 2: error.")
    p.add_argument("host", help="the host, as its agent names it (trainguard launch --host)")
    p.add_argument("--note", default="",
                   help="why, kept in the entry until it is removed (default: who ran it)")
    add_connection_flags(p)
    p.set_defaults(run=lambda args: asyncio.run(run(args)))


async def run(args: argparse.Namespace) -> int:
    extras.require("services", "trainguard unblock")
    from redis.exceptions import WatchError

    from trainguard.runtime.store import connect_redis

    host = check_token("host", args.host)
    settings = settings_from(args)
    key = Keys(settings.prefix).blocklist()
    redis = await connect_redis(settings.redis_url, timeout=settings.connect_timeout,
                                access=settings.access.redis_options())
    by = f"trainguard unblock by {getpass.getuser()}" + (f": {args.note}" if args.note else "")
    try:
        async with redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    raw = await pipe.hget(key, host)
                    entry = read_blocklist_entry(raw) if raw is not None else None
                    now = time.time()
                    if entry is None or not entry.active(now):
                        print(f"trainguard unblock: {host} is not on the blocklist")
                        return 1
                    entry.expires, entry.released_by = now, by
                    pipe.multi()  # type: ignore[no-untyped-call]
                    pipe.hset(key, host, encode_blocklist_entry(entry))
                    await pipe.execute()
                    break
                except WatchError:
                    continue  # the remediator wrote meanwhile: decide again on what it wrote
    finally:
        await redis.aclose()
    origin = f" (job {entry.job}, {entry.cause})" if entry.job else ""
    print(f"trainguard unblock: {host} may join jobs again{origin}; the remediator "
          "removes the entry and runs its release hook")
    return 0
