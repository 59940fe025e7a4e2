"""``trainguard observe JOB`` / ``trainguard act JOB``: whether the remediator carries out
its decisions on a job, or only records and pages them ("would have ...").

Observe-only lets a platform team compare trainguard's calls with its own on-call's before
letting it act. The mode is a value in Redis (``Keys.modes()``, a :class:`JobMode` per job)
that the remediator reads each time a step is about to take effect, so a switch needs no
restart of anything and holds across a remediator failover. A job without one follows the
policy's ``[observe]`` section. It takes a role whose Redis user may write the mode:
``operator`` (or the remediator's).

    trainguard observe train-7                          # observe every action
    trainguard observe train-7 --actions isolate,restart  # observe these, act on the rest
    trainguard observe --show train-7                   # print the mode in force
    trainguard act train-7                              # act again
    exit 0: done; 2: error (a bad argument names the flag and what it takes)
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import time
from typing import cast

from trainguard.contract.errors import ConfigError
from trainguard.contract.schemas import OBSERVABLE_ACTIONS, JobMode, ObservableAction
from trainguard.contract.subjects import check_token
from trainguard.runtime.state import Keys, encode_job_mode, read_job_mode

from . import extras
from .common import add_connection_flags, settings_from


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("observe", help="observe-only: the remediator decides and pages, "
                                       "and carries out nothing (or --actions only)",
                       description="Put JOB in observe-only mode: every decision is made, "
                                   "recorded on the incident as 'observed' and paged as "
                                   "'would have ...', and nothing is carried out. Takes "
                                   "effect at the remediator's next step, no restart. "
                                   "--show prints the mode in force.")
    p.add_argument("job", help="the job, as its ranks name it (TRAINGUARD_JOB)")
    p.add_argument("--actions", default="", metavar="KIND[,KIND...]",
                   help="observe only these action kinds and act on the others; of "
                        f"{', '.join(sorted(OBSERVABLE_ACTIONS))} (default: every one)")
    p.add_argument("--show", action="store_true", help="print the job's mode, change nothing")
    p.add_argument("--note", default="", help="why, kept with the mode (default: who ran it)")
    add_connection_flags(p)
    p.set_defaults(run=lambda args: asyncio.run(run(args, "observe")))

    a = sub.add_parser("act", help="let the remediator carry out its decisions on a job again",
                       description="Put JOB in act mode: the remediator carries out its "
                                   "decisions again from its next step (no restart); this "
                                   "also wins over a policy whose [observe] mode is observe.")
    a.add_argument("job", help="the job, as its ranks name it (TRAINGUARD_JOB)")
    a.add_argument("--note", default="", help="why, kept with the mode (default: who ran it)")
    add_connection_flags(a)
    a.set_defaults(run=lambda args: asyncio.run(run(args, "act")), show=False, actions="")


def parse_actions(text: str) -> list[ObservableAction]:
    """``--actions`` as a list of observable kinds; anything else names the flag and the
    kinds it takes (``alert`` and ``escalate`` change nothing, so they always run)."""
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in OBSERVABLE_ACTIONS]
    if bad:
        raise ConfigError(f"--actions: cannot observe {', '.join(bad)}; use a comma-separated "
                          f"list of {', '.join(sorted(OBSERVABLE_ACTIONS))} (alert and "
                          "escalate change nothing and always run)")
    return [cast(ObservableAction, k) for k in dict.fromkeys(kinds)]


def describe(job: str, mode: JobMode | None) -> str:
    """One line for ``--show``: the job's own mode, or that the policy's applies."""
    if mode is None:
        return f"{job}: no mode of its own; the remediator's policy ([observe]) applies"
    what = ("act: decisions are carried out" if mode.mode == "act" else
            f"observe: {', '.join(sorted(mode.observed()))} recorded, not carried out"
            + ("" if mode.actions else " (every action)"))
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(mode.time)) if mode.time else ""
    by = ", ".join(p for p in (mode.by, when) if p)
    return f"{job}: {what}" + (f" [set by {by}]" if by else "")


async def run(args: argparse.Namespace, verb: str) -> int:
    extras.require("services", f"trainguard {verb}")
    from trainguard.runtime.store import connect_redis

    job = check_token("job", args.job)
    if args.show and args.actions:
        raise ConfigError("--show changes nothing: drop --actions, or drop --show to set them")
    actions = parse_actions(args.actions)
    settings = settings_from(args)
    key = Keys(settings.prefix).modes()
    redis = await connect_redis(settings.redis_url, timeout=settings.connect_timeout,
                                access=settings.access.redis_options())
    try:
        if args.show:
            raw = await redis.hget(key, job)
            print(describe(job, read_job_mode(raw) if raw is not None else None))
            return 0
        by = f"trainguard {verb} by {getpass.getuser()}" + (f": {args.note}" if args.note
                                                            else "")
        mode = JobMode(mode="observe" if verb == "observe" else "act", actions=actions,
                       by=by, time=time.time())
        await redis.hset(key, job, encode_job_mode(mode))
    finally:
        await redis.aclose()
    print(describe(job, mode) + "; the remediator applies it from its next step")
    return 0
