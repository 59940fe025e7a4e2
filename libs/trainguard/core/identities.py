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

Any of them is revoked through the account's revocation list (:class:`Revocations`), which
:func:`revoke` hands to the running server as the system account's user.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import nkeys

from trainguard.contract.binding import RANK_KINDS
from trainguard.contract.errors import ConfigError, TrainguardError
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
    CLAIMS_UPDATE,
    INBOX_ROOT,
    Key,
    Permissions,
    account_jwt,
    claims_of,
    creds,
    jwt_of_creds,
    operator_jwt,
    user_jwt,
    verified_claims,
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
        ranks are asked for, or a credential it replaces is not one of this host's ranks of
        this job (:meth:`replaced`)."""
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
        try:
            self.replaced(job, host, req)
        except ValueError as exc:
            return RankCredentialsReply(ok=False, reason=str(exc))
        expires = (now if now is not None else time.time()) + ttl
        jwts = {rank: user_jwt(self.signer, self.account, key, f"rank-{job}-{rank}@{host}",
                               rank_permissions(prefix, job, rank), expires)
                for rank, key in req.keys.items()}
        return RankCredentialsReply(ok=True, jwts=jwts, expires=expires)

    def replaced(self, job: str, host: str, req: RankCredentialsRequest
                 ) -> dict[str, float | None]:
        """The credentials ``req`` replaces (user public key -> expiry): each must be a
        rank credential this minter signed for ``job`` on ``host`` (so an agent revokes
        none of another host's); raises ValueError."""
        out: dict[str, float | None] = {}
        for token in req.replaces:
            claims = verified_claims(token, self.signer.public)
            name = str(claims.get("name", ""))
            if (claims.get("nats", {}).get("issuer_account") != self.account
                    or not (name.startswith(f"rank-{job}-") and name.endswith(f"@{host}"))):
                raise ValueError(f"{name!r} is not a rank credential of job {job!r} on "
                                 f"host {host!r}: not replaced")
            exp = claims.get("exp")
            out[str(claims["sub"])] = float(exp) if exp is not None else None
        return out


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
    home: Path | None = None
    """Where it is kept (its revocation list too): :meth:`ensure`'s directory."""

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
            return Trust(operator, system, account, signer, home=directory)
        trust = Trust.new()
        for key, path in zip((trust.operator, trust.system, trust.account, trust.signer),
                             paths, strict=True):
            write_private(path, key.seed + "\n")
        return Trust(trust.operator, trust.system, trust.account, trust.signer, home=directory)

    @property
    def minter(self) -> Minter:
        return Minter(self.account.public, self.signer)

    @property
    def revocations(self) -> Revocations:
        if self.home is None:
            raise ConfigError("this trust is kept nowhere (Trust.ensure(directory) keeps "
                              "it, and its revocation list beside it)")
        return Revocations(self.home / REVOCATIONS)

    def account_jwt(self, now: float | None = None) -> str:
        """The account's JWT as the server should hold it now: its signing key and the
        revocations in force."""
        revoked = self.revocations.current(now) if self.home is not None else {}
        return account_jwt(self.operator, self.account.public, self.name,
                           (self.signer.public,), revocations=revoked)

    def server_config(self, jwt_dir: Path) -> str:
        """nats-server's operator mode: the operator JWT and the NATS-based ``full``
        resolver storing account JWTs under ``jwt_dir`` (the server's own), preloaded with
        both accounts (the account's revocations in force included). A full resolver takes
        an updated account JWT from the system account (:func:`push_account`): that is
        how a revocation reaches a running server; the memory resolver takes none."""
        op = operator_jwt(self.operator, self.name)
        system = account_jwt(self.operator, self.system.public, "SYS", jetstream=False)
        return (f'operator: "{op}"\n'
                f"system_account: {self.system.public}\n"
                f"resolver: {{type: full, dir: {json.dumps(str(jwt_dir))}, "
                "allow_delete: false}\n"
                "resolver_preload: {\n"
                f'  {self.system.public}: "{system}"\n'
                f'  {self.account.public}: "{self.account_jwt()}"\n'
                "}\n")


REVOCATIONS: Final = "revocations.json"


class RevocationFailed(TrainguardError):
    """The server did not take the account's updated JWT (its revocations)."""


@dataclass(frozen=True)
class Revocations:
    """The account's revocation list, kept in ``path`` (beside the trust): user public key
    -> when it was revoked and when its credential would have expired anyway. The file is
    what every revoker (the issuer, ``trainguard credentials --revoke``) adds to under a
    lock, and what the account JWT is made from, so none undoes another's; an entry is
    dropped once its credential has expired (the server refuses it then anyway)."""

    path: Path

    def add(self, keys: Mapping[str, float | None], now: float | None = None
            ) -> dict[str, int]:
        """Revoke ``keys`` (user public key -> its credential's expiry, None: never) as
        of ``now``; returns the revocations in force."""
        now = time.time() if now is None else now
        with self._locked():
            entries = self._read()
            for key, expires in keys.items():
                entries[key] = {"at": int(now), "expires": expires}
            entries = self._live(entries, now)
            write_private(self.path, json.dumps(entries, indent=1, sort_keys=True) + "\n")
        return {k: int(v["at"]) for k, v in entries.items()}

    def current(self, now: float | None = None) -> dict[str, int]:
        """User public key -> the time at or before which its JWTs are refused."""
        entries = self._live(self._read(), time.time() if now is None else now)
        return {k: int(v["at"]) for k, v in entries.items()}

    @staticmethod
    def _live(entries: dict[str, Any], now: float) -> dict[str, Any]:
        return {k: v for k, v in entries.items()
                if v.get("expires") is None or v["expires"] > now}

    def _read(self) -> dict[str, Any]:
        try:
            out = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except ValueError as exc:
            raise ConfigError(f"{self.path}: not a revocation list ({exc}); restore it "
                              "or remove it (its revocations are then lifted)") from None
        return out if isinstance(out, dict) else {}

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield


async def push_account(nc: Any, trust: Trust, timeout: float = 5.0) -> None:
    """Hand the running server the account's JWT as it is now (``$SYS.REQ.CLAIMS.UPDATE``
    on ``nc``, a connection of the system account: :func:`ensure_system_creds`); the server
    then refuses revoked credentials and ends their connections. Raises
    :class:`RevocationFailed`."""
    try:
        msg = await nc.request(CLAIMS_UPDATE, trust.account_jwt().encode(), timeout=timeout)
        reply = json.loads(msg.data)
    except Exception as exc:
        raise RevocationFailed(f"the server did not answer the account update ({exc!r})"
                               ) from None
    error = reply.get("error") if isinstance(reply, dict) else "an unreadable reply"
    if error:
        raise RevocationFailed(f"the server refused the account update: {error}")


async def revoke(nc: Any, trust: Trust, keys: Mapping[str, float | None]) -> None:
    """Revoke ``keys`` (user public key -> its credential's expiry) in the trust's list and
    on the server (``nc``: a system account connection). Raises :class:`RevocationFailed`
    (the list keeps them: the server's next account update, or restart, applies them)."""
    trust.revocations.add(keys)
    await push_account(nc, trust)


def user_key_of(creds_or_key: str) -> tuple[str, float | None]:
    """The user public key (and its expiry) a revocation names: a ``U...`` key, or the
    path of a ``.creds`` file. Raises ConfigError naming what to give."""
    if is_user_key(creds_or_key):
        return creds_or_key, None
    try:
        claims = claims_of(jwt_of_creds(Path(creds_or_key).read_text()))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--revoke {creds_or_key!r}: give a user public key (U...) or a "
                          f".creds file ({exc})") from None
    exp = claims.get("exp")
    return str(claims["sub"]), float(exp) if exp is not None else None


def expiry_of(creds_text: str) -> float | None:
    """When the credential in ``creds_text`` expires (Unix time), or None for never."""
    exp = claims_of(jwt_of_creds(creds_text)).get("exp")
    return float(exp) if exp is not None else None


PER_IDENTITY: Final = frozenset({"rank", "agent"})
"""Roles that get no shared credential in ``jwt`` mode: each rank and each host's agent
has its own (:meth:`Minter.mint_rank`, :meth:`Minter.mint_agent`)."""


def _signed_by(path: Path, issuer: Key, permissions: Permissions | None = None) -> bool:
    """Whether ``path`` holds a credential ``issuer`` (of the current trust) minted (one
    from a trust made anew would be refused) and, if given, with ``permissions``."""
    try:
        claims = claims_of(jwt_of_creds(path.read_text()))
    except (OSError, ValueError):
        return False
    if claims.get("iss") != issuer.public:
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
    if not _signed_by(path, trust.signer, permissions):
        write_private(path, trust.minter.mint("issuer", permissions))
    return path


SYSTEM_PERMISSIONS: Final = Permissions(publish=(CLAIMS_UPDATE,), subscribe=(f"{INBOX_ROOT}.>",))
"""The system account user's: it hands the server the account's updated JWT, nothing else."""


def ensure_system_creds(directory: Path, trust: Trust) -> Path:
    """``sys.creds``: a user of the server's system account (signed by that account's own
    key), for revocations (:func:`push_account`); it belongs to the control plane only."""
    path = directory / "sys.creds"
    if not _signed_by(path, trust.system, SYSTEM_PERMISSIONS):
        write_private(path, Minter(trust.system.public, trust.system).mint(
            "trainguard-revoker", SYSTEM_PERMISSIONS))
    return path


def ensure_role_creds(directory: Path, trust: Trust, prefix: str) -> dict[Role, Path]:
    """``<role>.creds`` for every shared role (the services, on-call, operator) under
    ``directory``, minted once (no expiry: the control plane's own processes)."""
    out: dict[Role, Path] = {}
    for role in ROLES:
        if role in PER_IDENTITY:
            continue
        path = directory / f"{role}.creds"
        if not _signed_by(path, trust.signer):
            write_private(path, trust.minter.mint_role(role, prefix))
        out[role] = path
    return out
