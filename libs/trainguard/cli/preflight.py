"""``trainguard preflight``: check this node before a job starts on it.

    trainguard preflight [--job J] [--host NAME] [--checks nvml,ib,...] [--json]
                         [--publish] [--checkpoint-root DIR] [--gpu-reading FILE]

Runs the pre-flight checks (``trainguard.health``) and prints the record; ``--json`` prints
it as JSON for scripts, ``--publish`` also sends it on ``tg.<job>.event.preflight`` (where
the remediator's policy blocklists a failed node). Exit 0: passed (warnings included);
1: a check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys

from trainguard.contract.codec import encode_durable
from trainguard.contract.errors import ConfigError
from trainguard.contract.schemas import PreflightReport
from trainguard.core.identity import host_token
from trainguard.runtime.config import load_settings

EXIT_FAILED = 1


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("preflight", help="check this node (GPUs, links, bandwidth, disk)",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", default="preflight", help="the job the record is for")
    p.add_argument("--host", help="this node's name (default: the hostname)")
    p.add_argument("--checks", help="comma-separated: nvml, dcgm, ib, allreduce, disk "
                   "(env TRAINGUARD_PREFLIGHT_CHECKS; default all)")
    p.add_argument("--json", action="store_true", help="print the record as JSON")
    p.add_argument("--publish", action="store_true",
                   help="also publish the record to the control plane")
    p.add_argument("--checkpoint-root", metavar="DIR", help="where to test write throughput")
    p.add_argument("--gpu-reading", metavar="FILE",
                   help="a recorded nvidia-smi -q report read instead of NVML")
    p.add_argument("--sysfs-root", metavar="DIR", help="sysfs (default /sys)")
    p.add_argument("--dcgm-level", type=int, help="dcgmi diag -r LEVEL (0: not run)")
    p.add_argument("--ib-rate", type=float, metavar="GBPS",
                   help="the rate every InfiniBand/RoCE port must reach")
    p.add_argument("--allreduce-procs", type=int, metavar="N",
                   help="ranks of the bandwidth test (0: one per GPU)")
    p.add_argument("--nats", metavar="URL")
    p.add_argument("--prefix")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from trainguard.agent.gpu import open_source
    from trainguard.contract.subjects import check_token
    from trainguard.health import preflight
    from trainguard.health.settings import PreflightSettings

    settings = load_settings(PreflightSettings, overrides={
        "preflight_checks": args.checks, "checkpoint_root": args.checkpoint_root,
        "gpu_reading": args.gpu_reading, "sysfs_root": args.sysfs_root,
        "preflight_dcgm_level": args.dcgm_level, "preflight_ib_rate_gbps": args.ib_rate,
        "preflight_allreduce_procs": args.allreduce_procs, "nats_url": args.nats,
        "prefix": args.prefix})
    host = args.host or host_token(socket.gethostname())
    try:
        check_token("job", args.job)
        check_token("host", host)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    source, why = open_source(settings.gpu_reading)
    try:
        gpus = source.sample() if source is not None else None
    finally:
        if source is not None:
            source.close()
    report = preflight.run(settings, job=args.job, host=host, gpus=gpus, gpu_why=why,
                           trigger="cli")
    if args.json:
        sys.stdout.write(encode_durable(report).decode() + "\n")
    else:
        print(preflight.render(report))
    if args.publish:
        asyncio.run(_publish(settings, report))
    return EXIT_FAILED if report.status == "fail" else 0


async def _publish(settings: object, report: PreflightReport) -> None:
    from trainguard.runtime.bus import Bus, connect_nats
    from trainguard.runtime.config import Settings

    assert isinstance(settings, Settings)
    nc = await connect_nats(settings.nats_url, name=f"trainguard-preflight-{report.host}",
                            timeout=settings.connect_timeout,
                            access=settings.access.nats_options())
    bus = Bus(nc, settings.subjects, source=f"trainguard/cli/{report.host}")
    try:
        await bus.publish_durable(settings.subjects.event(report.job, "preflight"), report)
    finally:
        await bus.close()
