"""``trainguard up``: the whole control plane in one command.

With no ``--nats``/``--redis`` it starts embedded servers on loopback (default ports 4222
and 6379), then every installed service in this process, prints where everything
listens and a status line per service, and stops it all on Ctrl-C or SIGTERM.

The embedded servers run with auth on: one NATS user and one Redis ACL user per role
(``trainguard.auth``), their credentials kept under ``<data-dir>/creds`` (mode 0600) and
reused on the next start. Each service connects as its own role; agents, ranks and on-call
tools take theirs from there (``--credentials`` / ``TRAINGUARD_CREDENTIALS``).
``--insecure`` starts them without auth, for a quick local try.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .. import extras, registry, tracing
from ..auth import ensure_credentials, nats_authorization, redis_acl_file, role_of_service
from ..config import DEFAULT_NATS_PORT, DEFAULT_REDIS_PORT, Settings
from ..embedded import NatsServer, RedisServer, ServerProcess
from ..errors import ConfigError
from .common import add_connection_flags, settings_from, tcp_port

if TYPE_CHECKING:
    from ..service import Runtime, Service

log = logging.getLogger("trainguard.up")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("up", help="run the whole control plane (embedded servers by default)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_connection_flags(p)
    p.add_argument("--nats-port", type=tcp_port, default=DEFAULT_NATS_PORT,
                   help=f"port of the embedded nats-server (default {DEFAULT_NATS_PORT})")
    p.add_argument("--redis-port", type=tcp_port, default=DEFAULT_REDIS_PORT,
                   help=f"port of the embedded redis-server (default {DEFAULT_REDIS_PORT})")
    p.add_argument("--data-dir", default=".trainguard",
                   help="where embedded servers keep their data (default ./.trainguard)")
    p.add_argument("--insecure", action="store_true",
                   help="embedded servers without authentication (a quick local try only)")
    p.add_argument("--services", default="all",
                   help="comma-separated services to run, or 'all' (default), or 'none'")
    p.set_defaults(run=run)


def _say(line: str) -> None:
    print(line, flush=True)


def _selected(spec: str) -> list[str]:
    names = sorted(registry.available())
    if spec == "all":
        return names
    if spec == "none":
        return []
    wanted = [n.strip() for n in spec.split(",") if n.strip()]
    for n in wanted:
        registry.load(n)  # unknown names fail here with the list of known ones
    return wanted


def run(args: argparse.Namespace) -> int:
    extras.require("services", "trainguard up")
    names = _selected(args.services)
    base = settings_from(args)  # validates URLs given on the command line
    servers: list[ServerProcess] = []
    data = Path(args.data_dir).resolve()
    urls = {"nats_url": base.nats_url, "redis_url": base.redis_url}
    embedded = [flag is None for flag in (args.nats, args.redis)]
    secure = not args.insecure and any(embedded)
    if secure and not all(embedded):
        raise ConfigError("up: give both --nats and --redis (external servers, your own "
                          "credentials) or neither (embedded servers, generated ones), or "
                          "add --insecure")
    creds_dir = data / "creds"
    nats_auth = redis_auth = ""
    if secure:
        creds = ensure_credentials(creds_dir)
        nats_auth = nats_authorization(creds, base.prefix)
        redis_auth = redis_acl_file(creds, base.prefix)
    plan: tuple[tuple[str | None, str, ServerProcess], ...] = (
        (args.nats, "nats_url", NatsServer(args.nats_port, data / "nats", auth=nats_auth)),
        (args.redis, "redis_url", RedisServer(args.redis_port, data / "redis",
                                              auth=redis_auth)),
    )
    try:
        for flag, key, server in plan:
            label = f"{server.kind.split('-')[0]}:".ljust(6)
            if flag is not None:
                _say(f"{label} {urls[key]} (external)")
                continue
            server.start()
            servers.append(server)
            urls[key] = server.url
            _say(f"{label} {server.url} (embedded, pid {server.pid}, data {server.data_dir})")
        if secure:
            _say(f"creds: {creds_dir} (agents: --credentials {creds_dir / 'agent.json'} "
                 f"--rank-credentials {creds_dir / 'rank.json'}; on-call: "
                 f"{creds_dir / 'oncall.json'})")
        elif any(embedded):
            _say("auth:  off (--insecure): any local process can command the job")
        tracing.setup_tracing("trainguard-up", base.otel_exporter)
        return asyncio.run(_serve(names, base.replace(**urls),
                                  creds_dir if secure else None))
    finally:
        for server in reversed(servers):
            server.stop()


async def _serve(names: list[str], base: Settings, creds_dir: Path | None) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = []
    for name in names:
        try:
            cls = registry.load(name)
        except Exception as exc:  # a broken service must not stop the rest
            _say(f"{name}: cannot load ({exc!r}); skipped")
            continue
        tasks.append(asyncio.create_task(
            _supervise(cls(_settings_for(cls, base, creds_dir)), stop), name=name))
    if not names:
        _say("services: none installed")
    _say("trainguard up: running; Ctrl-C or SIGTERM stops everything")
    await stop.wait()
    _say("trainguard up: stopping")
    await asyncio.gather(*tasks, return_exceptions=True)
    return 0


def _settings_for(cls: type[Service], base: Settings, creds_dir: Path | None) -> Settings:
    from ..config import load_settings

    shared = {k: getattr(base, k) for k in ("nats_url", "redis_url", "prefix", "otel_exporter",
                                            "credentials")}
    if creds_dir is not None:  # each service as its own role
        shared["credentials"] = str(creds_dir / f"{role_of_service(cls.name)}.json")
    return load_settings(cls.settings_type, overrides=shared)


async def _supervise(service: Service, stop: asyncio.Event) -> None:
    """Run one service; if it crashes, report it and start it again with backoff."""
    from ..service import run_service

    delay = 1.0
    while not stop.is_set():
        def _started(rt: Runtime) -> None:
            port = rt.health.port if rt.health else 0
            _say(f"{service.name}: ready (health http://{rt.settings.health_host}:{port}/readyz)")

        try:
            await run_service(service, stop, install_signals=False, started=_started)
        except Exception as exc:
            _say(f"{service.name}: failed ({exc}); restarting in {delay:.0f}s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            delay = min(30.0, delay * 2)
    print(f"{service.name}: stopped", file=sys.stdout, flush=True)
