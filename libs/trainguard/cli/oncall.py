"""What on-call looks at: ``trainguard status``, ``events`` and ``incidents``.

All three read the control plane's state (Redis) and event history (JetStream) only; none
of them needs a service to be running.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import TYPE_CHECKING, Any

import msgspec

from trainguard.contract.codec import decode_durable
from trainguard.contract.schemas import Anomaly, Diagnosis, Incident
from trainguard.contract.subjects import EVENT_KINDS
from trainguard.runtime import eventlog
from trainguard.runtime.bus import connect_nats
from trainguard.runtime.config import Settings
from trainguard.runtime.state import Keys, decode_progress, read_blocklist_entry

from . import incident_show
from .common import add_connection_flags, settings_from

if TYPE_CHECKING:
    from rich.console import Console


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    for name, helptext, fn in (
        ("status", "jobs, ranks, open incidents and the blocklist", _status),
        ("incidents", "incidents with their timings (`incidents show ID`: one in full)",
         _incidents),
        ("events", "the event history (anomalies, diagnoses, actions, incidents, ...)", _events),
    ):
        p = sub.add_parser(name, help=helptext, description=helptext)
        p.add_argument("--job", help="only this job")
        p.add_argument("--json", action="store_true", help="one JSON object per line")
        if name == "events":
            p.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
            p.add_argument("--kind", choices=EVENT_KINDS, help="only events of this kind")
        add_connection_flags(p)
        p.set_defaults(run=lambda args, fn=fn: asyncio.run(fn(args)))
        if name == "incidents":
            shows = p.add_subparsers(dest="incidents_command", metavar="show ID")
            q = shows.add_parser("show", help="one incident: timeline, evidence and actions",
                                 description="One incident: its timeline, the evidence "
                                             "behind its cause, and every action with its "
                                             "status and commands.")
            q.add_argument("id", help="incident id, or a unique prefix of it")
            q.add_argument("--job", help="only look in this job")
            q.add_argument("--json", action="store_true",
                           help="one JSON object: incident, diagnoses, anomalies")
            add_connection_flags(q)
            q.set_defaults(run=lambda args: asyncio.run(_incident_show(args)))


async def _jobs(redis: Any, keys: Keys, only: str | None) -> list[str]:
    if only:
        return [only]
    found = {str(j) for j in await redis.smembers(keys.jobs())}
    async for key in redis.scan_iter(match=keys.progress("*")):
        found.add(str(key).rsplit(":", 1)[-1])
    async for key in redis.scan_iter(match=keys.incidents("*")):
        name = str(key).rsplit(":", 1)[-1]
        if name != "open":
            found.add(name)
    return sorted(found)


async def _load_incidents(redis: Any, keys: Keys, job: str) -> list[Incident]:
    raw = await redis.hgetall(keys.incidents(job))
    out = [decode_durable(v.encode() if isinstance(v, str) else v, Incident) for v in raw.values()]
    return sorted(out, key=lambda i: i.detected_at or 0)


def _console() -> Console:
    """Rich wraps to 80 columns when piped; tables of incidents need more."""
    from rich.console import Console  # the services extra: loaded by the command only

    return Console(width=None if sys.stdout.isatty() else 200)


def _ago(t: float | None) -> str:
    return "-" if not t else f"{time.time() - t:.0f}s ago"


def _span(a: float | None, b: float | None) -> str:
    return f"{b - a:.1f}s" if a and b else "-"


async def _status(args: argparse.Namespace) -> int:
    settings: Settings = settings_from(args)
    keys = Keys(settings.prefix)
    from trainguard.runtime.store import connect_redis

    redis = await connect_redis(settings.redis_url, timeout=settings.connect_timeout,
                                access=settings.access.redis_options())
    console = _console()
    try:
        now = time.time()
        blocklist = {str(host): entry
                     for host, raw in (await redis.hgetall(keys.blocklist())).items()
                     if (entry := read_blocklist_entry(raw)).active(now)}
        report: dict[str, Any] = {"jobs": {}, "blocklist": msgspec.to_builtins(blocklist)}
        for job in await _jobs(redis, keys, args.job):
            raw = await redis.get(keys.progress(job))
            progress = decode_progress(raw) if raw else None
            incidents = [i for i in await _load_incidents(redis, keys, job)
                         if i.status in ("open", "mitigating")]
            report["jobs"][job] = {"progress": msgspec.to_builtins(progress) if progress else None,
                                   "open_incidents": [msgspec.to_builtins(i) for i in incidents]}
        if args.json:
            print(json.dumps(report))
            return 0
        for job, info in report["jobs"].items():
            p = info["progress"]
            if p is None:
                console.print(f"[bold]{job}[/]: no progress reported (is the detector running?)")
            else:
                states: dict[str, int] = {}
                for r in p["ranks"].values():
                    states[r["state"]] = states.get(r["state"], 0) + 1
                console.print(f"[bold]{job}[/]: step {p['last_step']}  world {p['world_size']}  "
                              f"attempt {p['attempt']}  median step "
                              f"{(p['median_step_time'] or 0) * 1000:.0f} ms  ranks "
                              + ", ".join(f"{n} {s}" for s, n in sorted(states.items())))
            for inc in info["open_incidents"]:
                console.print(f"  incident {inc['id'][:8]} {inc['cause']} {inc['status']} "
                              f"hosts {','.join(inc['hosts'])} since "
                              f"{_ago(inc['detected_at'])}: {inc['summary']}")
        if not report["jobs"]:
            console.print("no jobs known")
        for host, entry in blocklist.items():
            origin = f" (job {entry.job}, {entry.cause}, {_ago(entry.time)})" if entry.job else ""
            if entry.expires:
                origin += f", ends in {entry.expires - now:.0f}s"
            console.print(f"blocklisted: [bold]{host}[/] {entry.reason}{origin}")
        return 0
    finally:
        await redis.aclose()


async def _all_incidents(settings: Settings, job: str | None) -> list[Incident]:
    keys = Keys(settings.prefix)
    from trainguard.runtime.store import connect_redis

    redis = await connect_redis(settings.redis_url, timeout=settings.connect_timeout,
                                access=settings.access.redis_options())
    try:
        return [i for j in await _jobs(redis, keys, job)
                for i in await _load_incidents(redis, keys, j)]
    finally:
        await redis.aclose()


async def _incidents(args: argparse.Namespace) -> int:
    rows = await _all_incidents(settings_from(args), args.job)
    if args.json:
        for i in rows:
            print(json.dumps(msgspec.to_builtins(i)))
        return 0
    from rich.table import Table

    table = Table("incident", "job", "cause", "status", "hosts", "detect", "mitigate",
                  "recover", "steps lost", "actions")
    for i in rows:
        table.add_row(i.id[:8], i.job, i.cause, i.status, ",".join(i.hosts),
                      _span(i.onset_at, i.detected_at), _span(i.detected_at, i.mitigated_at),
                      _span(i.detected_at, i.resolved_at),
                      "-" if i.steps_lost is None else str(i.steps_lost),
                      " ".join(f"{a.action}:{a.status}" for a in i.actions))
    _console().print(table)
    return 0


async def _incident_show(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    inc = incident_show.pick(await _all_incidents(settings, args.job), args.id)
    nc = await connect_nats(settings.nats_url, name="trainguard-incidents",
                            timeout=settings.connect_timeout,
                            access=settings.access.nats_options())
    try:
        history = [e async for e in eventlog.read(
            nc.jetstream(), settings.prefix,
            settings.subjects.pattern("event", job=inc.job, tail=">"))]
    finally:
        await nc.close()
    entities = eventlog.latest(history)
    diagnoses = [d for i in inc.diagnosis_ids
                 if isinstance(d := entities.get(i), Diagnosis)]
    anomaly_ids = dict.fromkeys([*inc.anomaly_ids, *(a for d in diagnoses
                                                     for a in d.anomaly_ids)])
    anomalies = [a for i in anomaly_ids if isinstance(a := entities.get(i), Anomaly)]
    if args.json:
        print(json.dumps({"incident": msgspec.to_builtins(inc),
                          "diagnoses": msgspec.to_builtins(diagnoses),
                          "anomalies": msgspec.to_builtins(anomalies)}))
    else:
        print("\n".join(incident_show.render(inc, diagnoses, anomalies)))
    return 0


async def _events(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    subject = settings.subjects.pattern("event", job=args.job or "*", tail=args.kind or ">")
    nc = await connect_nats(settings.nats_url, name="trainguard-events",
                            timeout=settings.connect_timeout,
                            access=settings.access.nats_options())
    console = _console()
    try:
        async for e in eventlog.read(nc.jetstream(), settings.prefix, subject,
                                     follow=args.follow):
            if e.event is None:
                console.print(f"[red]undecodable event on {e.subject}: {e.error}[/]")
            elif args.json:
                print(json.dumps({"subject": e.subject, "type": e.ce_type,
                                  "event": json.loads(e.data)}), flush=True)
            else:
                body = msgspec.to_builtins(e.event)
                what = body.get("kind") or body.get("cause") or body.get("action") or \
                    body.get("status")
                console.print(f"{e.time} {e.subject} [bold]{what}[/] "
                              f"{body.get('summary') or body.get('ranks') or ''}")
        return 0
    finally:
        await nc.close()
