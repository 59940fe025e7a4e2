"""``trainguard credentials``: per-role secrets and access rules for external servers.

``trainguard up`` makes its own for the embedded servers; for servers you run yourself,
this writes what they and each trainguard process need::

    trainguard credentials --out /etc/trainguard      # <role>.json, nats-auth.conf,
                                                       # redis-users.acl (mode 0600)
    nats-server -c deploy/nats-server.conf            # include the generated nats-auth.conf
    redis-server deploy/redis.conf --aclfile /etc/trainguard/redis-users.acl
    # replicated: deploy/redis-ha.conf and deploy/sentinel.conf include the
    # redis-replication.conf and sentinel-auth.conf written here
    TRAINGUARD_CREDENTIALS=/etc/trainguard/agent.json trainguard launch ...

``--job J`` narrows the rank and agent permissions to one job (one file set per job).
``--template`` prints the shipped ``deploy/nats-auth.conf`` (passwords from environment
variables) instead.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from trainguard.contract.errors import ConfigError
from trainguard.contract.subjects import DEFAULT_PREFIX, check_token
from trainguard.core.auth import (
    ROLES,
    generate,
    nats_authorization,
    nats_authorization_template,
    redis_acl_file,
    write_credentials,
    write_private,
)
from trainguard.runtime.redisha import HaSecrets


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("credentials", help="write per-role credentials and server access rules",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="directory to write into (created; files are mode 0600)")
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help="subject and key prefix (default tg)")
    p.add_argument("--job", default="*", help="narrow rank and agent permissions to one job")
    p.add_argument("--template", action="store_true",
                   help="print the nats-server authorization block with passwords from "
                        "TG_<ROLE>_PASSWORD variables (the shipped deploy/nats-auth.conf)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.job != "*":
        check_token("job", args.job)
    if args.template:
        print(nats_authorization_template(args.prefix), end="")
        return 0
    if not args.out:
        raise ConfigError("credentials: give --out DIR (where to write the files) or "
                          "--template")
    out = Path(args.out)
    creds = generate(ROLES)
    paths = write_credentials(out, creds)
    write_private(out / "nats-auth.conf", nats_authorization(creds, args.prefix, args.job))
    ha = HaSecrets.generate()  # replicas' and sentinels' logins (deploy/redis-ha.conf)
    write_private(out / "redis-users.acl", redis_acl_file(creds, args.prefix) + ha.acl_lines())
    write_private(out / "redis-replication.conf", ha.data_node_conf())
    write_private(out / "sentinel-auth.conf", ha.sentinel_conf())
    for role, path in paths.items():
        print(f"{role}: {path}")
    print(f"nats-server: include {out / 'nats-auth.conf'} in its config")
    print(f"redis-server: --aclfile {out / 'redis-users.acl'} (replicas and sentinels: "
          f"include {out / 'redis-replication.conf'} / {out / 'sentinel-auth.conf'})")
    return 0
