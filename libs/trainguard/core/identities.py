"""Identities scoped to what each process is: one rank of one job, one host's agent, a
service; their NATS permissions and the user credentials (``.creds``) that carry them.

The static mode (:mod:`.auth`) gives every rank one user and every agent one user: a rank
may then publish any rank's telemetry and an agent bind any host's command consumer. In
``jwt`` mode the control plane mints a user per identity, signed by the deployment's
account (:class:`Trust`), with permissions naming its own subjects only:

* rank ``R`` of job ``J``: publish ``tg.J.{hb,step,fp,snap,ckpt,recovery,reg}.R``, acks and
  ``rpc.resume``; subscribe ``cmd.all``, ``cmd.rank.R`` and its own reply inbox
  (``_INBOX.J.rR.>``, which :meth:`trainguard.core.auth.Access.nats_options` reads back
  from the credential); short-lived;
* the agent of host ``H`` of job ``J``: its host's telemetry, hello and exits, its ranks'
  recovery reports, acks, the dead-letter subject, ``rpc.save``, ``rpc.creds.H`` (its
  ranks' credentials, :mod:`trainguard.runtime.issuer`: asked on its own host's subject
  only, so the issuer knows which host asks), its node's pre-flight event;
  subscribe ``cmd.all``, ``cmd.host.H`` and its inbox; and of JetStream's API only
  what its own durable command consumer (``agent-J-H``) needs to be read, pulled and
  acknowledged: the control plane creates it at the agent's ask (``rpc.consumer.H``),
  with the job's and the host's command subjects as its filters;
* a service role: the same permissions as in the static mode;
* the issuer: it answers ``rpc.creds.<host>`` and ``rpc.consumer.<host>``, and creates
  agents' command consumers.
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import nkeys

from trainguard.contract.binding import RANK_KINDS
from trainguard.contract.rpc import RankCredentialsReply, RankCredentialsRequest
from trainguard.contract.subjects import (
    Subjects,
    bucket_name,
    check_rank,
    check_token,
    stream_name,
)

from .auth import ROLES, Role, nats_permissions, write_private
from .natsjwt import (
    INBOX_ROOT,
    Key,
    Permissions,
    account_jwt,
    claims_of,
    creds,
    jwt_of_creds,
    operator_jwt,
    user_jwt,
)


def is_user_key(key: str) -> bool:
    """Whether ``key`` is an nkey user public key (``U``, base32, its checksum right)."""
    try:
        raw = base64.b32decode(key + "=" * (-len(key) % 8))
    except (ValueError, TypeError):
        return False
    return (len(raw) == 35 and key.startswith("U")
            and nkeys.crc16(bytearray(raw[:-2])).to_bytes(2, "little") == raw[-2:])


def issuer_permissions(prefix: str) -> Permissions:
    """The control plane's issuer: it hears ``rpc.creds.<host>`` and
    ``rpc.consumer.<host>`` of every job and answers; of JetStream's API it may only read
    the command stream and create a durable on it (an agent's command consumer)."""
    s = Subjects(prefix)
    cmds = stream_name(prefix, "cmds")
    return Permissions(publish=(s.dead_pattern(), f"$JS.API.STREAM.INFO.{cmds}",
                                f"$JS.API.CONSUMER.DURABLE.CREATE.{cmds}.*"),
                       subscribe=(s.pattern("rpc", tail="creds.*"),
                                  s.pattern("rpc", tail="consumer.*"),
                                  f"{INBOX_ROOT}.>"), responses=True)


def agent_durable(job: str, host: str) -> str:
    """The command consumer of ``host``'s agent: named after the host, so a permission
    can name it."""
    return f"agent-{check_token('job', job)}-{check_token('host', host)}"


def rank_inbox(job: str, rank: int) -> str:
    return f"{INBOX_ROOT}.{check_token('job', job)}.r{check_rank(rank)}"


def agent_inbox(job: str, host: str) -> str:
    return f"{INBOX_ROOT}.{check_token('job', job)}.h-{check_token('host', host)}"


def rank_permissions(prefix: str, job: str, rank: int) -> Permissions:
    """Rank ``rank`` of ``job``: its own telemetry and reports, nothing of another's."""
    s = Subjects(prefix)
    r = check_rank(rank)
    return Permissions(
        publish=(*(s.pattern(k, job, str(r)) for k in sorted(RANK_KINDS)),
                 s.pattern("ack", job),
                 s.rpc_resume(job)),
        subscribe=(s.cmd_all(job), s.cmd_rank(job, r), f"{rank_inbox(job, r)}.>"))


def agent_permissions(prefix: str, job: str, host: str) -> Permissions:
    """The agent of ``host`` in ``job``: its host's subjects and its own command consumer,
    which it may read, pull and acknowledge but not create: a consumer's filter subjects
    travel in the create request's body (with two filters, the subject-based form that
    names one is refused), so no permission could keep it to its own host's. It asks the
    control plane for it (``rpc.consumer.H``, :mod:`trainguard.runtime.issuer`)."""
    s = Subjects(prefix)
    h = check_token("host", host)
    cmds = stream_name(prefix, "cmds")
    durable = agent_durable(job, host)
    api = "$JS.API"
    fence = f"KV_{bucket_name(prefix)}"
    consumer = (f"{api}.CONSUMER.INFO.{cmds}.{durable}",
                f"{api}.CONSUMER.MSG.NEXT.{cmds}.{durable}",
                f"$JS.ACK.{cmds}.{durable}.>")
    return Permissions(
        publish=(s.gpu(job, h), s.node(job, h), s.exit(job, h), s.fr(job, h),
                 s.reg_node(job, h), s.pattern("recovery", job), s.pattern("ack", job), s.dead(job),
                 s.rpc_save(job), s.rpc_creds(job, h), s.rpc_consumer(job, h),
                 s.event(job, "preflight"),
                 f"{api}.INFO", f"{api}.STREAM.INFO.*", f"{api}.STREAM.NAMES", *consumer,
                 f"{api}.DIRECT.GET.{fence}", f"{api}.DIRECT.GET.{fence}.>",
                 f"{api}.STREAM.MSG.GET.{fence}"),
        subscribe=(s.cmd_all(job), s.cmd_host(job, h), f"{agent_inbox(job, h)}.>"))


def role_permissions(role: Role, prefix: str) -> Permissions:
    """A service's (or a person's) role, as in the static mode: it serves every job."""
    return Permissions.from_server_block(nats_permissions(role, prefix))


@dataclass(frozen=True)
class Minter:
    """Mints users of ``account`` (its public key) with its signing key ``signer``: the
    one secret an issuer holds; whoever holds it may mint any identity."""

    account: str
    signer: Key

    def mint(self, name: str, permissions: Permissions, ttl: float | None = None,
             now: float | None = None) -> str:
        """A ``.creds`` file's text for a fresh user ``name`` with ``permissions``,
        expiring ``ttl`` seconds from ``now`` (never, if None)."""
        user = Key.new("user")
        expires = None if ttl is None else (now if now is not None else time.time()) + ttl
        token = user_jwt(self.signer, self.account, user.public, name, permissions, expires)
        return creds(token, user.seed)

    def mint_rank(self, prefix: str, job: str, rank: int, ttl: float) -> str:
        return self.mint(f"rank-{job}-{rank}", rank_permissions(prefix, job, rank), ttl)

    def mint_agent(self, prefix: str, job: str, host: str, ttl: float | None = None) -> str:
        return self.mint(f"agent-{job}-{host}", agent_permissions(prefix, job, host), ttl)

    def mint_role(self, role: Role, prefix: str, ttl: float | None = None) -> str:
        return self.mint(role, role_permissions(role, prefix), ttl)

    def issue(self, prefix: str, job: str, host: str, req: RankCredentialsRequest,
              ttl: float, limit: int, now: float | None = None) -> RankCredentialsReply:
        """The issuer's answer to the agent of ``host`` in ``job`` (both the subject's:
        the server lets an agent's credential ask on its own job's and host's subject
        only): a JWT per rank for the public key the agent made, expiring ``ttl`` seconds
        from ``now``, named after the rank and that host (``rank-J-R@H``). Refused whole
        if the body names another host, any rank or key is bad, or more than ``limit``
        ranks are asked for."""
        if req.host != host:
            return RankCredentialsReply(ok=False, reason=f"the request names host "
                                                         f"{req.host!r} on host {host!r}'s "
                                                         "subject")
        if not req.keys or len(req.keys) > limit:
            return RankCredentialsReply(ok=False, reason=f"ask for 1 to {limit} ranks, not "
                                                         f"{len(req.keys)}")
        for rank, key in req.keys.items():
            if rank < 0 or not is_user_key(key):
                return RankCredentialsReply(ok=False, reason=f"rank {rank}: {key!r} is not "
                                                             "a user public key (U...)")
        expires = (now if now is not None else time.time()) + ttl
        jwts = {rank: user_jwt(self.signer, self.account, key, f"rank-{job}-{rank}@{host}",
                               rank_permissions(prefix, job, rank), expires)
                for rank, key in req.keys.items()}
        return RankCredentialsReply(ok=True, jwts=jwts, expires=expires)


KEY_FILES: Final = ("operator", "system", "account", "signer")


@dataclass(frozen=True)
class Trust:
    """The deployment's trust chain: the operator, the ``SYS`` account nats-server needs,
    and the account every trainguard user belongs to, with its signing key."""

    operator: Key
    system: Key
    account: Key
    signer: Key
    name: str = "trainguard"

    @staticmethod
    def new(name: str = "trainguard") -> Trust:
        return Trust(Key.new("operator"), Key.new("account"), Key.new("account"),
                     Key.new("account"), name)

    @staticmethod
    def ensure(directory: Path) -> Trust:
        """The trust kept under ``directory`` (``<key>.nk`` seeds, mode 0600), made once:
        a restarted control plane keeps it, so every credential minted stays valid."""
        paths = [directory / f"{k}.nk" for k in KEY_FILES]
        if all(p.is_file() for p in paths):
            operator, system, account, signer = (Key(p.read_text().strip()) for p in paths)
            return Trust(operator, system, account, signer)
        trust = Trust.new()
        for key, path in zip((trust.operator, trust.system, trust.account, trust.signer),
                             paths, strict=True):
            write_private(path, key.seed + "\n")
        return trust

    @property
    def minter(self) -> Minter:
        return Minter(self.account.public, self.signer)

    def server_config(self) -> str:
        """nats-server's operator mode: the operator JWT, the accounts preloaded into a
        memory resolver (no account server to run)."""
        op = operator_jwt(self.operator, self.name)
        system = account_jwt(self.operator, self.system.public, "SYS", jetstream=False)
        account = account_jwt(self.operator, self.account.public, self.name,
                              (self.signer.public,))
        return (f'operator: "{op}"\n'
                f"system_account: {self.system.public}\n"
                "resolver: MEMORY\n"
                "resolver_preload: {\n"
                f'  {self.system.public}: "{system}"\n'
                f'  {self.account.public}: "{account}"\n'
                "}\n")


def expiry_of(creds_text: str) -> float | None:
    """When the credential in ``creds_text`` expires (Unix time), or None for never."""
    exp = claims_of(jwt_of_creds(creds_text)).get("exp")
    return float(exp) if exp is not None else None


PER_IDENTITY: Final = frozenset({"rank", "agent"})
"""Roles that get no shared credential in ``jwt`` mode: each rank and each host's agent
has its own (:meth:`Minter.mint_rank`, :meth:`Minter.mint_agent`)."""


def _signed_by(path: Path, trust: Trust, permissions: Permissions | None = None) -> bool:
    """Whether ``path`` holds a credential the current trust's signing key minted (one
    from a trust made anew would be refused) and, if given, with ``permissions``."""
    try:
        claims = claims_of(jwt_of_creds(path.read_text()))
    except (OSError, ValueError):
        return False
    if claims.get("iss") != trust.signer.public:
        return False
    if permissions is None:
        return True
    nats = claims.get("nats", {})
    return bool(nats.get("pub", {}).get("allow") == list(permissions.publish)
                and nats.get("sub", {}).get("allow") == list(permissions.subscribe))


def ensure_issuer_creds(directory: Path, trust: Trust, prefix: str) -> Path:
    """``issuer.creds``: the control plane's issuer's own identity, minted again when its
    permissions changed."""
    path = directory / "issuer.creds"
    permissions = issuer_permissions(prefix)
    if not _signed_by(path, trust, permissions):
        write_private(path, trust.minter.mint("issuer", permissions))
    return path


def ensure_role_creds(directory: Path, trust: Trust, prefix: str) -> dict[Role, Path]:
    """``<role>.creds`` for every shared role (the services, on-call, operator) under
    ``directory``, minted once (no expiry: the control plane's own processes)."""
    out: dict[Role, Path] = {}
    for role in ROLES:
        if role in PER_IDENTITY:
            continue
        path = directory / f"{role}.creds"
        if not _signed_by(path, trust):
            write_private(path, trust.minter.mint_role(role, prefix))
        out[role] = path
    return out
