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

``--jwt`` is NATS's decentralized auth instead of one user per role: the trust chain
(``trust/``: operator, account and its signing key, made once and kept), the server's
``nats-operator.conf`` (operator mode, the NATS-based ``full`` resolver storing account
JWTs under ``nats-jwt/``: ``include`` it), a ``<role>.creds`` for each service and on-call
role, ``sys.creds`` (the system account's: revocations), and, per identity, a credential
naming its own subjects only; ``--revoke`` revokes one (its ``.creds`` or its key) on the
running server and in the config::

    trainguard credentials --jwt --out /etc/trainguard --agent job1:node-a --agent job1:node-b
    trainguard credentials --jwt --out /run/tg --rank job1:0 --rank job1:1 --ttl 3600
    TRAINGUARD_CREDENTIALS=/run/tg/rank-job1-0.creds python train.py   # one rank
    trainguard credentials --jwt --out /run/tg --revoke /run/tg/rank-job1-1.creds --nats URL
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

from trainguard.contract.errors import ConfigError
from trainguard.contract.subjects import DEFAULT_PREFIX, check_rank, check_token
from trainguard.core.auth import (
    ROLES,
    generate,
    nats_authorization,
    nats_authorization_template,
    redis_acl_file,
    write_credentials,
    write_private,
)
from trainguard.runtime.config import Settings, load_settings
from trainguard.runtime.redisha import HaSecrets

if TYPE_CHECKING:
    from trainguard.core.identities import Trust


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("credentials", help="write per-role credentials and server access rules",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="directory to write into (created; files are mode 0600)")
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help="subject and key prefix (default tg)")
    p.add_argument("--job", default="*", help="narrow rank and agent permissions to one job")
    p.add_argument("--jwt", action="store_true",
                   help="decentralized auth: trust chain, operator-mode server config, "
                        "<role>.creds, and per-identity creds (--agent, --rank)")
    p.add_argument("--agent", action="append", default=[], metavar="JOB:HOST",
                   help="with --jwt: mint agent-JOB-HOST.creds (repeatable)")
    p.add_argument("--rank", action="append", default=[], metavar="JOB:RANK",
                   help="with --jwt: mint rank-JOB-RANK.creds (repeatable)")
    p.add_argument("--ttl", type=float, default=3600.0,
                   help="with --jwt: seconds a rank's credential lives (default 3600); "
                        "agents' never expire unless --agent-ttl")
    p.add_argument("--agent-ttl", type=float, default=None,
                   help="with --jwt: seconds an agent's credential lives (default: no expiry; "
                        "an agent does not renew its own: give it one that outlives the job)")
    p.add_argument("--revoke", action="append", default=[], metavar="CREDS|UKEY",
                   help="with --jwt: revoke an identity (its .creds file, or its user public "
                        "key U... as connz shows it; repeatable): added to trust/revocations.json "
                        "and handed to the running server (--nats), which ends its connections")
    p.add_argument("--nats", metavar="URL", help="with --revoke: the server to hand the "
                   "revocation to, as the system account (sys.creds) (env TRAINGUARD_NATS_URL; "
                   "default nats://127.0.0.1:4222)")
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
    if args.jwt:
        return _run_jwt(args, out)
    if args.agent or args.rank or args.revoke:
        raise ConfigError("credentials: --agent, --rank and --revoke are per-identity "
                          "credentials; add --jwt (the static mode has one user per role)")
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


def _pair(flag: str, value: str) -> tuple[str, str]:
    job, sep, name = value.partition(":")
    what, example = ("HOST", "node-a") if flag == "--agent" else ("RANK", "0")
    if not sep:
        raise ConfigError(f"credentials: {flag} {value!r}: write JOB:{what} (e.g. {flag} "
                          f"job1:{example})")
    return check_token("job", job), name


def _run_jwt(args: argparse.Namespace, out: Path) -> int:
    """The trust (made once under ``out/trust``), the server's config, the shared roles'
    ``.creds`` and Redis users, and each ``--agent``/``--rank`` credential asked for."""
    from trainguard.core.auth import ensure_credentials
    from trainguard.core.identities import (
        Trust,
        ensure_role_creds,
        ensure_system_creds,
        user_key_of,
    )

    if args.ttl <= 0 or (args.agent_ttl is not None and args.agent_ttl <= 0):
        raise ConfigError("credentials: --ttl and --agent-ttl are seconds, more than 0")
    # Every identity checked before any file is written.
    agents = [(job, check_token("host", host)) for job, host in
              (_pair("--agent", v) for v in args.agent)]
    ranks = [(job, check_rank(rank)) for job, rank in (_pair("--rank", v) for v in args.rank)]
    revoked = dict(user_key_of(v) for v in args.revoke)
    trust = Trust.ensure(out / "trust")
    if revoked:  # in the server's config too: a restarted server keeps them
        trust.revocations.add(revoked)
    write_private(out / "nats-operator.conf", trust.server_config(out / "nats-jwt"))
    system = ensure_system_creds(out, trust)
    creds = ensure_credentials(out)  # the Redis users: Redis has no JWTs
    write_private(out / "redis-users.acl", redis_acl_file(creds, args.prefix))
    for role, path in ensure_role_creds(out, trust, args.prefix).items():
        print(f"{role}: {path}")
    minter = trust.minter
    for job, host in agents:
        path = out / f"agent-{job}-{host}.creds"
        write_private(path, minter.mint_agent(args.prefix, job, host, args.agent_ttl))
        print(f"agent {host} of {job}: {path}")
    for job, rank in ranks:
        path = out / f"rank-{job}-{rank}.creds"
        write_private(path, minter.mint_rank(args.prefix, job, rank, args.ttl))
        print(f"rank {rank} of {job}: {path} (expires in {args.ttl:.0f} s)")
    print(f"nats-server: include {out / 'nats-operator.conf'} in its config (operator mode)")
    print(f"redis-server: --aclfile {out / 'redis-users.acl'}")
    if revoked:
        asyncio.run(_push(args, trust, system))
        print(f"revoked {', '.join(sorted(revoked))} (the server ends their connections)")
    return 0


async def _push(args: argparse.Namespace, trust: Trust, system: Path) -> None:
    """Hand the account's JWT, revocations included, to the running server."""
    from trainguard.core.identities import push_account
    from trainguard.runtime.bus import connect_as

    base = load_settings(Settings, overrides={"nats_url": args.nats})
    try:
        nc = await connect_as(base, system, "trainguard-credentials")
    except Exception as exc:
        raise ConfigError(f"credentials: --revoke: no connection to {base.nats_url} ({exc!r}); "
                          "give the server's URL with --nats (the revocation is kept in "
                          "nats-operator.conf: a server restarted with it refuses them too)"
                          ) from None
    try:
        await push_account(nc, trust)
    finally:
        await nc.close()
