"""``trainguard dashboard``: the live web dashboard (one page, server-sent events).

It reads the bus only, as the on-call role (``--credentials <data-dir>/creds/oncall.json``
with ``trainguard up``'s servers): ranks' heartbeats and step reports, incidents and
checkpoints from the event history. ``trainguard up`` starts one as well
(``--dashboard-port``).
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from trainguard.dashboard import DEFAULT_PORT, DashboardServer, run_dashboard

from .common import add_connection_flags, settings_from, tcp_port


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("dashboard", help="the live web dashboard (ranks, incidents, goodput)",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", help="only this job (default: every job on the bus)")
    p.add_argument("--port", type=tcp_port, default=DEFAULT_PORT,
                   help=f"HTTP port (default {DEFAULT_PORT})")
    p.add_argument("--bind", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; 0.0.0.0 for every "
                        "interface, e.g. in a pod)")
    add_connection_flags(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)

        def started(server: DashboardServer) -> None:
            print(f"dashboard: http://{args.bind}:{server.port}/", flush=True)

        await run_dashboard(settings, host=args.bind, port=args.port, job=args.job,
                            stop=stop, started=started)

    asyncio.run(main())
    return 0
