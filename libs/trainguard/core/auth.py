"""Roles, their NATS permissions and Redis ACLs, and the credentials each process uses.

Only the control plane may act on a job: the remediator and the checkpoint coordinator
publish commands and answer the coordinator's endpoints, ranks publish their own telemetry,
reports and acks, agents their host's samples and exits, on-call tools read events and may
ask for a save. The permission tables below are the one place that says so; the embedded
servers of ``trainguard up``, ``trainguard credentials`` (for an external server) and the
shipped ``deploy/`` configuration are all rendered from them.

A credentials file is JSON, one per role, readable by its owner only::

    {"role": "agent", "nats": {"user": "agent", "password": "..."},
     "redis": {"user": "agent", "password": "..."}}

Redis 6.2 (the embedded server) has no per-command key selectors, so an agent's ACL names
the only keys it touches (the blocklist and the fencing epoch, both read only) and the
read commands it needs; the services' users may use every ``<prefix>:*`` key.
"""

from __future__ import annotations

import json
import os
import secrets
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, get_args

import msgspec

from trainguard.contract.errors import ConfigError

from .files import write_atomically

Role = Literal["rank", "agent", "detector", "diagnoser", "remediator", "checkpointer",
               "service", "oncall", "operator"]
"""``service``: a plugin service (not one of the four), with a service's reach but no
command or endpoint of its own."""
ROLES: Final[tuple[Role, ...]] = get_args(Role)
SERVICE_ROLES: Final[frozenset[str]] = frozenset(
    {"detector", "diagnoser", "remediator", "checkpointer"})

INBOX: Final = "_INBOX.>"
JS_ACK: Final = "$JS.ACK.>"


class Secret(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    user: str
    password: str


class Credentials(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What one process presents to NATS and Redis (either may be absent)."""

    role: Role
    nats: Secret | None = None
    redis: Secret | None = None


def nats_permissions(role: Role, prefix: str = "tg", job: str = "*") -> dict[str, Any]:
    """The nats-server ``permissions`` block of ``role``; ``job`` narrows a rank's or an
    agent's to one job (the control plane serves every job).

    JetStream's API is the services' alone: they provision streams and own the durable
    consumers. An agent may only create, read and ack consumers of the command stream; an
    on-call tool only read the event and dead-letter streams (ordered consumers, with their
    flow control). Nobody but the services may delete a consumer or touch a stream.
    """
    from trainguard.contract.subjects import Subjects, bucket_name, stream_name

    p = f"{prefix}.{job if role in ('rank', 'agent') else '*'}"

    def consumers_of(stream: str, *, pull: bool) -> list[str]:
        api = "$JS.API.CONSUMER"
        out = [f"{api}.CREATE.{stream}", f"{api}.CREATE.{stream}.>",
               f"{api}.DURABLE.CREATE.{stream}.*", f"{api}.INFO.{stream}.*"]
        return out + ([f"{api}.MSG.NEXT.{stream}.*", f"$JS.ACK.{stream}.>"] if pull
                      else ["$JS.FC.>"])

    info = ["$JS.API.INFO", "$JS.API.STREAM.INFO.*", "$JS.API.STREAM.NAMES"]
    # The leader's current epoch, read where only the remediator's role may write it.
    fence = f"KV_{bucket_name(prefix)}"
    fence_reader = [f"$JS.API.DIRECT.GET.{fence}", f"$JS.API.DIRECT.GET.{fence}.>",
                    f"$JS.API.STREAM.MSG.GET.{fence}"]
    readers = info + consumers_of(stream_name(prefix, "events"), pull=False) \
        + consumers_of(stream_name(prefix, "dead"), pull=False)
    publish: list[str]
    subscribe: list[str] = [INBOX]
    responses = False
    match role:
        case "rank":
            publish = [f"{p}.{k}.*" for k in ("hb", "step", "fp", "ckpt", "reg", "ack",
                                               "recovery", "snap")]
            publish += [f"{p}.rpc.resume"]
            subscribe += [f"{p}.cmd.all", f"{p}.cmd.rank.*"]
        case "agent":
            publish = [f"{p}.{k}.*" for k in ("gpu", "node", "exit", "fr", "reg", "ack",
                                               "recovery")]
            # Its node's pre-flight record is the one event an agent publishes itself.
            publish += [f"{p}.dead", f"{p}.rpc.save", f"{p}.event.preflight", *info,
                        *consumers_of(stream_name(prefix, "cmds"), pull=True),
                        *fence_reader]
            subscribe += [f"{p}.cmd.all", f"{p}.cmd.host.*"]
        case "detector" | "diagnoser" | "remediator" | "checkpointer" | "service":
            publish = [f"{p}.event.*", f"{p}.dead", "$JS.API.>", JS_ACK]
            subscribe += [f"{prefix}.>", "$JS.EVENT.>"]
            if role in ("detector", "remediator"):  # ask after its peers' presence
                publish += [Subjects(prefix).presence_pattern()]  # (runtime.presence)
            if role == "remediator":  # and draw its fencing epochs (trainguard.runtime.fencing)
                publish += [f"{p}.cmd.>", f"{p}.rpc.*", f"$KV.{bucket_name(prefix)}.>"]
            if role == "checkpointer":
                publish += [f"{p}.cmd.>"]
                responses = True
        case "oncall":
            publish = [f"{p}.rpc.save", f"{p}.rpc.checkpoints", *readers]
            # Telemetry too, read only: the dashboard's heat map of ranks.
            subscribe += [f"{p}.event.>", f"{p}.dead", f"{p}.hb.*", f"{p}.step.*",
                          f"{p}.node.*"]
        case "operator":
            # Drills (``trainguard inject``, the demo) and what on-call does. It can command
            # a job like the control plane: a person's credentials, never a process's.
            publish = [f"{p}.cmd.>", f"{p}.rpc.*", *readers]
            subscribe += [f"{prefix}.>"]
    out: dict[str, Any] = {"publish": {"allow": publish}, "subscribe": {"allow": subscribe}}
    if responses:
        out["allow_responses"] = True
    return out


def redis_acl(role: Role, password: str, prefix: str = "tg") -> str | None:
    """The ``user`` line of ``role`` in a Redis ACL file; None for roles without Redis.

    No role gets ``+client|setinfo``: Redis 7.0 refuses the rule (the subcommand came in
    7.2), and redis-py ignores the refusal of the command, so the file loads everywhere."""
    match role:
        case "rank":
            return None
        case "operator":
            # ``trainguard unblock``: read and rewrite a blocklist entry, optimistically;
            # ``trainguard observe`` / ``act``: read and set a job's remediation mode.
            keys = f"~{prefix}:blocklist ~{prefix}:mode"
            cmds = ("+ping +hget +hgetall +hset +watch +unwatch +multi +exec +discard "
                    "+client|setname")
        case "agent":
            # Read only: Redis 6.2 cannot grant a write on one key pattern alone, so any
            # write would reach the blocklist too. Its node record is the control plane's,
            # from its durable hellos; the leader's epoch it reads from the fence bucket.
            keys = f"~{prefix}:blocklist"
            cmds = "+ping +get +hget +client|setname"
        case "oncall":
            keys = f"~{prefix}:*"
            cmds = "+@read +ping +scan +client|setname"
        case _:
            keys = f"~{prefix}:*"
            cmds = "+@all -@dangerous +info +client|setname"
    return f"user {role} on >{password} resetkeys {keys} resetchannels {cmds}"


def generate(roles: tuple[Role, ...] = ROLES) -> dict[Role, Credentials]:
    """Fresh random passwords for every role (NATS and, where it has one, Redis)."""
    out: dict[Role, Credentials] = {}
    for role in roles:
        nats = Secret(user=role, password=secrets.token_urlsafe(24))
        redis = Secret(user=role, password=secrets.token_urlsafe(24)) \
            if redis_acl(role, "x") is not None else None
        out[role] = Credentials(role=role, nats=nats, redis=redis)
    return out


def nats_authorization(creds: dict[Role, Credentials], prefix: str = "tg",
                       job: str = "*") -> str:
    """The ``authorization`` block of a nats-server config (its syntax accepts JSON)."""
    users = [{"user": c.nats.user, "password": c.nats.password,
              "permissions": nats_permissions(role, prefix, job)}
             for role, c in creds.items() if c.nats is not None]
    return "authorization " + json.dumps({"users": users}, indent=2) + "\n"


def password_variable(role: Role) -> str:
    """The environment variable the shipped server config reads ``role``'s password from."""
    return f"TG_{role.upper()}_PASSWORD"


def nats_authorization_template(prefix: str = "tg") -> str:
    """The shipped ``deploy/nats-auth.conf``: every role's permissions, passwords from the
    server's environment (nats-server resolves ``$VAR`` references at start)."""
    users = [{"user": role, "password": "$" + password_variable(role),
              "permissions": nats_permissions(role, prefix)} for role in ROLES]
    body = json.dumps({"users": users}, indent=2)
    for role in ROLES:  # a variable reference is a bare word in nats-server's syntax
        var = password_variable(role)
        body = body.replace(f'"${var}"', f"${var}")
    return ("# Generated by `trainguard credentials --template` from trainguard/auth.py: one\n"
            "# user per role with its permissions; set TG_<ROLE>_PASSWORD in the server's\n"
            "# environment (or use `trainguard credentials --out DIR` for literal secrets).\n"
            "authorization " + body + "\n")


def redis_acl_file(creds: dict[Role, Credentials], prefix: str = "tg") -> str:
    """A Redis ACL file: the default user off, one user per role that uses Redis."""
    lines = ["user default off"]
    for role, c in creds.items():
        if c.redis is not None:
            line = redis_acl(role, c.redis.password, prefix)
            if line:
                lines.append(line)
    return "\n".join(lines) + "\n"


def write_private(path: Path, text: str) -> None:
    """Write ``text`` readable by its owner only (a secret never lands world-readable)."""
    write_atomically(path, text.encode(), mode=0o600)


def role_of_service(name: str) -> Role:
    """The role a service runs as: its own, or ``service`` for a plugin."""
    return name if name in SERVICE_ROLES else "service"  # type: ignore[return-value]


def ensure_credentials(directory: Path) -> dict[Role, Credentials]:
    """The credentials kept under ``directory``, made once: a restarted ``trainguard up``
    keeps them, so agents and ranks that hold them stay connected."""
    creds: dict[Role, Credentials] = {}
    missing: list[Role] = []
    for role in ROLES:
        try:
            creds[role] = load_credentials(directory / f"{role}.json")
        except ConfigError:
            missing.append(role)
    if missing:  # only those: the others' holders must keep working
        fresh = generate(tuple(missing))
        write_credentials(directory, fresh)
        creds.update(fresh)
    return {role: creds[role] for role in ROLES}


def write_credentials(directory: Path, creds: dict[Role, Credentials]) -> dict[Role, Path]:
    """One ``<role>.json`` per role under ``directory``; returns the paths."""
    paths: dict[Role, Path] = {}
    for role, c in creds.items():
        paths[role] = directory / f"{role}.json"
        write_private(paths[role], msgspec.json.encode(c).decode() + "\n")
    return paths


def load_credentials(path: str | os.PathLike[str]) -> Credentials:
    """Read a credentials file; a :class:`ConfigError` names the file and what is wrong."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"credentials file {path}: {exc.strerror}; create it with "
                          "`trainguard credentials` or point TRAINGUARD_CREDENTIALS at one"
                          ) from None
    try:
        return msgspec.json.decode(data, type=Credentials)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ConfigError(f"credentials file {path} is not valid: {exc}") from None


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """A CA bundle to verify the server, and a client certificate where it asks for one."""

    ca: str = ""
    cert: str = ""
    key: str = ""

    def __bool__(self) -> bool:
        return bool(self.ca or self.cert)

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca or None)
        if self.cert:
            ctx.load_cert_chain(self.cert, self.key or None)
        return ctx


@dataclass(frozen=True, slots=True)
class Access:
    """How one process proves who it is to NATS and Redis: a credentials file of its role
    (user/password for both), or NATS's own creds (JWT) / nkey seed files, plus TLS.

    Nothing here connects; :meth:`nats_options` and :meth:`redis_options` are keyword
    arguments for nats-py's ``connect`` and redis-py's ``from_url``.
    """

    credentials: Credentials | None = None
    nats_creds: str = ""
    nats_nkey: str = ""
    nats_tls: TlsFiles = TlsFiles()
    redis_tls: TlsFiles = TlsFiles()

    @property
    def role(self) -> str:
        return self.credentials.role if self.credentials else ""

    @property
    def own_identity(self) -> bool:
        """Whether the NATS credential is one identity's of ``jwt`` mode (a ``.creds`` file
        confining its replies to its own inbox), not a role shared by every process of it."""
        return bool(self.nats_creds) and _inbox_of_file(self.nats_creds) is not None

    def nats_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {}
        secret = self.credentials.nats if self.credentials else None
        if secret is not None and not self.nats_creds:
            options.update(user=secret.user, password=secret.password)
        if self.nats_creds:
            from .credsfile import CredsFile  # nkeys and PyNaCl: loaded only to connect

            options.update(CredsFile(self.nats_creds).options())
            inbox = _inbox_of_file(self.nats_creds)
            if inbox:  # the credential confines replies to its own inbox
                options["inbox_prefix"] = inbox
        if self.nats_nkey:
            options["nkeys_seed"] = self.nats_nkey
        if self.nats_tls:
            options["tls"] = self.nats_tls.context()
        return options

    def redis_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {}
        secret = self.credentials.redis if self.credentials else None
        if secret is not None:
            options.update(username=secret.user, password=secret.password)
        tls = self.redis_tls
        if tls.ca:
            options["ssl_ca_certs"] = tls.ca
        if tls.cert:
            options.update(ssl_certfile=tls.cert, ssl_keyfile=tls.key or None)
        return options


CREDS_HEAD: Final = b"-----BEGIN NATS USER JWT-----"
"""How a NATS ``.creds`` file starts (one identity's JWT and seed, ``jwt`` mode)."""


def is_creds_file(path: str) -> bool:
    """Whether ``path`` is a NATS ``.creds`` file rather than a role's JSON credentials."""
    try:
        with open(path, "rb") as f:
            return f.read(len(CREDS_HEAD)) == CREDS_HEAD
    except OSError:
        return False


def _inbox_of_file(path: str) -> str | None:
    from .natsjwt import inbox_of  # nkeys and PyNaCl: loaded only for a .creds file

    try:
        return inbox_of(Path(path).read_text())
    except (OSError, ValueError):
        return None  # nats-py reports what is wrong with the file when it connects


def access_from(credentials: str = "", *, nats_creds: str = "", nats_nkey: str = "",
                nats_tls: TlsFiles = TlsFiles(), redis_tls: TlsFiles = TlsFiles()) -> Access:
    """An :class:`Access` from setting values; file problems are :class:`ConfigError`.

    ``credentials`` may name a NATS ``.creds`` file (a rank's or an agent's own identity
    in ``jwt`` mode): it is then used as ``nats_creds``, so a rank needs one variable
    whichever mode the control plane runs."""
    if credentials and not nats_creds and is_creds_file(credentials):
        credentials, nats_creds = "", credentials
    for name, path in (("nats_creds", nats_creds), ("nats_nkey", nats_nkey),
                       ("nats_tls_ca", nats_tls.ca), ("nats_tls_cert", nats_tls.cert),
                       ("redis_tls_ca", redis_tls.ca), ("redis_tls_cert", redis_tls.cert)):
        if path and not Path(path).is_file():
            raise ConfigError(f"setting {name}={path!r}: no such file")
    return Access(credentials=load_credentials(credentials) if credentials else None,
                  nats_creds=nats_creds, nats_nkey=nats_nkey, nats_tls=nats_tls,
                  redis_tls=redis_tls)
