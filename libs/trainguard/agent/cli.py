"""The ``trainguard launch`` sub-command (registered through ``trainguard.commands``).

    trainguard launch --job J [--host NAME] [--allow-drills] [--nats URL] [--redis URL]
                      [torchrun options ...] -- train.py [args ...]

Options before ``--`` that trainguard does not know go to torchrun unchanged. Importing
this module is cheap: torch is imported only when a launch runs.
"""

from __future__ import annotations

import argparse
import socket
import sys

from trainguard.contract.errors import ConfigError
from trainguard.core.identity import host_token
from trainguard.runtime.config import load_settings

from .settings import AgentSettings

RAW_COMMAND = "launch"
USAGE = ("trainguard launch --job J [--host NAME] [--allow-drills] [torchrun options] "
         "-- train.py [args]")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("launch", help="run this node's ranks (torchrun's options), guarded",
                       usage=USAGE, description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter, add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(run=run)


def own_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trainguard launch", usage=USAGE, add_help=True)
    p.add_argument("--job", required=True, help="job name (letters, digits, '-', '_')")
    p.add_argument("--host", help="this node's name in trainguard (default: the hostname)")
    p.add_argument("--allow-drills", action="store_true",
                   help="accept fault drills (kill, freeze, nan, ...) for this job")
    p.add_argument("--nats", metavar="URL")
    p.add_argument("--redis", metavar="URL")
    p.add_argument("--prefix")
    p.add_argument("--credentials", metavar="FILE",
                   help="the agent role's credentials (env TRAINGUARD_CREDENTIALS)")
    p.add_argument("--rank-credentials", metavar="FILE",
                   help="the rank role's credentials, handed to the ranks "
                        "(env TRAINGUARD_RANK_CREDENTIALS)")
    p.add_argument("--log-root", metavar="DIR",
                   help="where launches keep their logs, one directory per job (default: "
                        "trainguard-logs in the temporary directory)")
    p.add_argument("--stop-grace", type=float, help="SIGTERM-to-SIGKILL grace (s)")
    p.add_argument("--preempt-grace", type=float, help="save-now deadline on SIGTERM (s)")
    p.add_argument("--warm-spares", type=int, metavar="N",
                   help="warm spare processes kept to replace ranks (default: one per local "
                        "rank; 0: none)")
    p.add_argument("--preflight", choices=("enforce", "warn", "off"),
                   help="the node's pre-flight before its ranks start: enforce (a failed "
                        "node starts none, exit 200), warn, or off (env TRAINGUARD_PREFLIGHT)")
    p.add_argument("--in-place", action=argparse.BooleanOptionalAction, default=None,
                   help="replace one failed rank while the others keep running, when the "
                        "trainer recovers in place (default on)")
    return p


def split(rest: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Our options, and torchrun's argv (its options, then the script and its args)."""
    if "--" not in rest:
        raise ConfigError(f"missing training script; usage: {USAGE}")
    cut = rest.index("--")
    head, script = rest[:cut], rest[cut + 1:]
    if not script:
        raise ConfigError(f"missing training script after '--'; usage: {USAGE}")
    ours, torch_opts = own_parser().parse_known_args(head)
    return ours, [*torch_opts, *script]


def run(args: argparse.Namespace) -> int:
    rest = list(args.rest)
    if rest[:1] in (["-h"], ["--help"]):
        own_parser().print_help()
        print("\nAll other options before '--' are torchrun's (python -m torch.distributed.run"
              " --help).")
        return 0
    ours, torchrun_argv = split(rest)
    settings = load_settings(AgentSettings, overrides={
        "job": ours.job, "host": ours.host or host_token(socket.gethostname()),
        "allow_drills": ours.allow_drills or None, "nats_url": ours.nats,
        "redis_url": ours.redis, "prefix": ours.prefix, "stop_grace": ours.stop_grace,
        "preempt_grace": ours.preempt_grace, "credentials": ours.credentials,
        "rank_credentials": ours.rank_credentials, "warm_spares": ours.warm_spares,
        "in_place": ours.in_place, "log_root": ours.log_root, "preflight": ours.preflight,
    })
    from trainguard.contract.subjects import check_token

    try:
        check_token("job", settings.job)
        check_token("host", settings.host)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    from trainguard.runtime import telemetry

    from .launcher import launch

    telemetry.setup_tracing(f"trainguard-agent-{settings.host}", settings.otel_exporter)
    sys.stdout.flush()
    return launch(settings, torchrun_argv)
