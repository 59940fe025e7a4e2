"""``trainguard up``: the whole control plane in one command.

With no ``--nats``/``--redis`` it starts embedded servers on loopback (default ports 4222
and 6379), then every installed service in this process, prints where everything
listens and a status line per service, and stops it all on Ctrl-C or SIGTERM.

The embedded servers run with auth on: one NATS user and one Redis ACL user per role
(``trainguard.core.auth``), their credentials kept under ``<data-dir>/creds`` (mode 0600) and
reused on the next start. Each service connects as its own role; agents, ranks and on-call
tools take theirs from there (``--credentials`` / ``TRAINGUARD_CREDENTIALS``).
``--insecure`` starts them without auth, for a quick local try.

Each service's ``/livez``, ``/readyz`` and ``/metrics`` listen on a fixed port, the base
port (``--base-port``, default 9460) plus the service's offset (``trainguard.runtime.ports``:
detector +1, diagnoser +2, remediator +3, checkpointer +4, bridge +5, dashboard +6), on
``--health-host`` (default 127.0.0.1; 0.0.0.0 to be scraped from elsewhere).
``--base-port 0`` takes free ports instead. A service that needs configuration it lacks
(the bridge without a sink) is skipped with the reason.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainguard.contract.envnames import setting
from trainguard.contract.errors import ConfigError
from trainguard.core.auth import ensure_credentials, role_of_service
from trainguard.core.identities import (
    Trust,
    ensure_issuer_creds,
    ensure_role_creds,
    ensure_system_creds,
    revoke,
)
from trainguard.dashboard import DEFAULT_PORT as DASHBOARD_PORT
from trainguard.dashboard import run_dashboard
from trainguard.runtime import registry, telemetry
from trainguard.runtime.config import DEFAULT_NATS_PORT, DEFAULT_REDIS_PORT, Settings
from trainguard.runtime.embedded import (
    NatsServer,
    RedisServer,
    ServerProcess,
    embedded_auth,
    port_taken,
)
from trainguard.runtime.ports import DEFAULT_BASE_PORT, health_port

from . import extras
from .common import add_connection_flags, settings_from, tcp_port

if TYPE_CHECKING:
    from trainguard.runtime.service import Runtime, Service

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
    p.add_argument("--auth", choices=("static", "jwt"), default=None, dest="auth_mode",
                   help="embedded nats-server's auth (env TRAINGUARD_AUTH_MODE): static, a "
                        "user per role (default); jwt, operator mode with a credential per "
                        "identity (per rank, per host: `trainguard credentials --jwt`)")
    p.add_argument("--insecure", action="store_true",
                   help="embedded servers without authentication (a quick local try only)")
    p.add_argument("--base-port", type=int, default=None,
                   help=f"health ports are this + each service's offset (env "
                        f"TRAINGUARD_BASE_PORT; default {DEFAULT_BASE_PORT}: detector "
                        f"{DEFAULT_BASE_PORT + 1} ...; 0: free ports)")
    p.add_argument("--health-host", default=None, metavar="ADDR",
                   help="bind address of the health servers (env TRAINGUARD_HEALTH_HOST; "
                        "default 127.0.0.1; 0.0.0.0 for scrapes and probes from elsewhere)")
    p.add_argument("--services", default="all",
                   help="comma-separated services to run, or 'all' (default), or 'none'")
    p.add_argument("--dashboard-port", type=tcp_port, default=None,
                   help="port of the web dashboard (default: the base port + 6, "
                        f"{DASHBOARD_PORT} with the default base)")
    p.add_argument("--no-dashboard", action="store_true", help="do not serve the dashboard")
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
    # validates URLs given on the command line
    base_port = args.base_port
    if base_port is None and setting("base_port") not in os.environ:
        base_port = DEFAULT_BASE_PORT
    base = settings_from(args, base_port=base_port, health_host=args.health_host,
                         auth_mode=args.auth_mode)
    _check_health_ports(names, base)
    servers: list[ServerProcess] = []
    data = Path(args.data_dir).resolve()
    urls = {"nats_url": base.nats_url, "redis_url": base.redis_url}
    embedded = [flag is None for flag in (args.nats, args.redis)]
    secure = not args.insecure and any(embedded)
    if secure and not all(embedded):
        raise ConfigError("up: give both --nats and --redis (external servers, your own "
                          "credentials) or neither (embedded servers, generated ones), or "
                          "add --insecure")
    if base.auth_mode == "jwt" and not secure:
        raise ConfigError("up: auth_mode=jwt (--auth jwt / TRAINGUARD_AUTH_MODE) sets up the "
                          "embedded servers; drop --insecure, --nats and --redis, or use "
                          "`trainguard credentials --jwt` for servers you run")
    creds_dir = data / "creds"
    nats_auth = redis_auth = ""
    jwt = secure and base.auth_mode == "jwt"
    if secure:
        creds = ensure_credentials(creds_dir)
        nats_auth, redis_auth = embedded_auth(creds_dir, creds, base.prefix, base.auth_mode,
                                              data / "nats")
        if jwt:
            ensure_role_creds(creds_dir, Trust.ensure(creds_dir / "trust"), base.prefix)
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
        if jwt:
            _say(f"creds: {creds_dir} (jwt: services and on-call <role>.creds; per host and "
                 f"per rank: trainguard credentials --jwt --trust {creds_dir / 'trust'})")
        elif secure:
            _say(f"creds: {creds_dir} (agents: --credentials {creds_dir / 'agent.json'} "
                 f"--rank-credentials {creds_dir / 'rank.json'}; on-call: "
                 f"{creds_dir / 'oncall.json'})")
        elif any(embedded):
            _say("auth:  off (--insecure): any local process can command the job")
        telemetry.setup_tracing("trainguard-up", base.otel_exporter, several=True)
        dashboard = None if args.no_dashboard else (
            args.dashboard_port if args.dashboard_port is not None
            else health_port("dashboard", base.base_port))
        return asyncio.run(_serve(names, base.replace(**urls),
                                  creds_dir if secure else None, dashboard, jwt))
    finally:
        for server in reversed(servers):
            server.stop()


async def _serve(names: list[str], base: Settings, creds_dir: Path | None,
                 dashboard: int | None = None, jwt: bool = False) -> int:
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
        settings = _settings_for(cls, base, creds_dir, jwt)
        if (why := cls.unconfigured(settings)) is not None:
            _say(f"{name}: skipped ({why})")
            continue
        tasks.append(asyncio.create_task(_supervise(cls(settings), stop), name=name))
    if dashboard is not None:
        tasks.append(asyncio.create_task(_dashboard(base, creds_dir, dashboard, stop, jwt)))
    if jwt and creds_dir is not None:
        tasks.append(asyncio.create_task(_issuer(base, creds_dir, stop)))
    if not names:
        _say("services: none installed")
    _say("trainguard up: running; Ctrl-C or SIGTERM stops everything")
    await stop.wait()
    _say("trainguard up: stopping")
    await asyncio.gather(*tasks, return_exceptions=True)
    return 0


def _check_health_ports(names: list[str], base: Settings) -> None:
    """Refuse to start when a fixed health port is taken (a second ``up``, an exporter):
    otherwise that service would restart forever, unreachable."""
    for name in names:
        port = health_port(name, base.base_port)
        if port and port_taken(port, "127.0.0.1" if base.health_host == "0.0.0.0"
                               else base.health_host):
            raise ConfigError(f"up: health port {port} of {name} (base port "
                              f"{base.base_port} + {port - base.base_port}) is already in "
                              "use; stop what holds it or pick another --base-port "
                              "(0: free ports)")


def _role_files(role: str, creds_dir: Path | None, jwt: bool) -> dict[str, str]:
    """The settings that make a process ``role``: its JSON file (NATS and Redis users), and
    in ``jwt`` mode its NATS ``.creds``."""
    if creds_dir is None:
        return {}
    out = {"credentials": str(creds_dir / f"{role}.json")}
    if jwt:
        out["nats_creds"] = str(creds_dir / f"{role}.creds")
    return out


def _settings_for(cls: type[Service], base: Settings, creds_dir: Path | None,
                  jwt: bool = False) -> Settings:
    from trainguard.runtime.config import load_settings

    shared = {k: getattr(base, k) for k in ("nats_url", "redis_url", "prefix", "otel_exporter",
                                            "credentials", "nats_creds", "base_port",
                                            "health_host")}
    shared.update(_role_files(role_of_service(cls.name), creds_dir, jwt))  # its own role
    return load_settings(cls.settings_type, overrides=shared)


async def _dashboard(base: Settings, creds_dir: Path | None, port: int,
                     stop: asyncio.Event, jwt: bool = False) -> None:
    """The web dashboard, as the on-call role; one that cannot start stops nothing else."""
    settings = base.replace(**_role_files("oncall", creds_dir, jwt))
    try:
        await run_dashboard(settings, host=base.health_host, port=port, stop=stop,
                            started=lambda s: _say(f"dashboard: http://{base.health_host}:"
                                                   f"{s.port}/"))
    except Exception as exc:
        _say(f"dashboard: not started ({exc})")


async def _issuer(base: Settings, creds_dir: Path, stop: asyncio.Event) -> None:
    """The credential issuer (``jwt`` mode): agents obtain their ranks' credentials from it.
    One that cannot start stops nothing else (ranks then get none: said here)."""
    from trainguard.runtime.bus import connect_as
    from trainguard.runtime.issuer import serve_issuer

    trust = Trust.ensure(creds_dir / "trust")
    conns: list[Any] = []

    async def connect(name: str, creds: Path) -> Any:
        conns.append(await connect_as(base, creds, name))
        return conns[-1]

    try:
        nc = await connect("trainguard-issuer", ensure_issuer_creds(creds_dir, trust,
                                                                    base.prefix))
        system = await connect("trainguard-revoker", ensure_system_creds(creds_dir, trust))
        await serve_issuer(nc, trust.minter, base.prefix, ttl=base.rank_creds_ttl,
                           revoke=functools.partial(revoke, system, trust))
    except Exception as exc:
        _say(f"issuer: not started ({exc}); ranks get no credentials")
    else:
        _say(f"issuer: ready (rank credentials for {base.rank_creds_ttl:.0f} s)")
        await stop.wait()
    for conn in conns:
        with contextlib.suppress(Exception):
            await conn.close()


async def _supervise(service: Service, stop: asyncio.Event) -> None:
    """Run one service; if it crashes, report it and start it again with backoff."""
    from trainguard.runtime.service import run_service

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
