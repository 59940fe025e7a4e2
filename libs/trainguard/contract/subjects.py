"""Subject names: the only place in trainguard that spells a subject string.

Layout (docs/design.md, section 3), with the default prefix ``tg``::

    tg.<job>.hb.<rank>          tg.<job>.step.<rank>        tg.<job>.fp.<rank>
    tg.<job>.gpu.<host>         tg.<job>.node.<host>        tg.<job>.exit.<host>
    tg.<job>.fr.<host>          (an agent's flight-recorder dumps)
    tg.<job>.ckpt.<rank>        tg.<job>.event.<kind>       tg.<job>.dead
    tg.<job>.recovery.<rank>    (a rank's account of an in-place or cold recovery)
    tg.<job>.snap.<rank>        (a rank's memory snapshots, telemetry)
    tg.<job>.reg.<rank>         tg.<job>.reg.host-<host>    (rank and node hellos)
    tg.<job>.cmd.all            tg.<job>.cmd.host.<host>    tg.<job>.cmd.rank.<rank>
    tg.<job>.ack.<issuer>       tg.<job>.rpc.resume
    tg.<job>.rpc.creds.<host>   tg.<job>.rpc.consumer.<host>   (an agent's asks, ``jwt`` mode)
    tg._presence.<role>.<digest>   (a service process's presence: see :meth:`presence`)

Jobs, hosts and issuers must be single tokens: letters, digits, ``-`` and ``_``. Anything
else is refused with :class:`InvalidToken` rather than mangled, because a silently
rewritten name would route telemetry of two jobs into one.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Final, Literal

from .errors import InvalidToken

_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,128}")

DEFAULT_PREFIX: Final = "tg"
NODE_REG_PREFIX: Final = "host-"
PRESENCE: Final = "_presence"
"""The job token of :meth:`Subjects.presence` (no job's subjects have its kinds)."""

EVENT_KINDS: Final[tuple[str, ...]] = ("anomaly", "diagnosis", "action", "incident", "checkpoint",
                                        "preflight")


def check_token(what: str, value: object) -> str:
    """Return ``value`` if it can be one subject token, else raise :class:`InvalidToken`."""
    if not isinstance(value, str):
        raise InvalidToken(what, value, "must be a string")
    if not _TOKEN.fullmatch(value):
        raise InvalidToken(
            what,
            value,
            "use 1-128 letters, digits, '-' or '_' (no dots, spaces or wildcards)",
        )
    return value


def check_rank(value: object) -> int:
    """Return ``value`` as a rank (a non-negative int), else raise :class:`InvalidToken`."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str) and value.isdigit():
            return int(value)
        raise InvalidToken("rank", value, "must be a non-negative integer")
    if value < 0:
        raise InvalidToken("rank", value, "must be a non-negative integer")
    return value


@dataclass(frozen=True, slots=True)
class Subjects:
    """Builds and parses subjects under one prefix.

    The prefix itself may have several tokens (``prod.tg``); everything after it has a
    fixed shape, which is what :meth:`parse` relies on.
    """

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        for part in self.prefix.split("."):
            check_token("subject prefix", part)

    @property
    def depth(self) -> int:
        return self.prefix.count(".") + 1

    def _job(self, job: str) -> str:
        return f"{self.prefix}.{check_token('job', job)}"

    # -- telemetry (core NATS) -------------------------------------------------------
    def hb(self, job: str, rank: int) -> str:
        return f"{self._job(job)}.hb.{check_rank(rank)}"

    def step(self, job: str, rank: int) -> str:
        return f"{self._job(job)}.step.{check_rank(rank)}"

    def fp(self, job: str, rank: int) -> str:
        return f"{self._job(job)}.fp.{check_rank(rank)}"

    def snap(self, job: str, rank: int) -> str:
        """A rank's :class:`~trainguard.contract.schemas.SnapshotReport` (telemetry)."""
        return f"{self._job(job)}.snap.{check_rank(rank)}"

    def gpu(self, job: str, host: str) -> str:
        return f"{self._job(job)}.gpu.{check_token('host', host)}"

    def node(self, job: str, host: str) -> str:
        return f"{self._job(job)}.node.{check_token('host', host)}"

    # -- durable (JetStream) ---------------------------------------------------------
    def exit(self, job: str, host: str) -> str:
        return f"{self._job(job)}.exit.{check_token('host', host)}"

    def fr(self, job: str, host: str) -> str:
        """An agent's flight-recorder dumps (``FlightRecorderReport``)."""
        return f"{self._job(job)}.fr.{check_token('host', host)}"

    def ckpt(self, job: str, rank: int) -> str:
        return f"{self._job(job)}.ckpt.{check_rank(rank)}"

    def recovery(self, job: str, rank: int) -> str:
        """A rank's :class:`~trainguard.contract.schemas.RecoveryReport` (durable)."""
        return f"{self._job(job)}.recovery.{check_rank(rank)}"

    def event(self, job: str, kind: str) -> str:
        if kind not in EVENT_KINDS:
            raise InvalidToken("event kind", kind, f"must be one of {', '.join(EVENT_KINDS)}")
        return f"{self._job(job)}.event.{kind}"

    def reg_rank(self, job: str, rank: int) -> str:
        return f"{self._job(job)}.reg.{check_rank(rank)}"

    def reg_node(self, job: str, host: str) -> str:
        return f"{self._job(job)}.reg.{NODE_REG_PREFIX}{check_token('host', host)}"

    def cmd_all(self, job: str) -> str:
        return f"{self._job(job)}.cmd.all"

    def cmd_host(self, job: str, host: str) -> str:
        return f"{self._job(job)}.cmd.host.{check_token('host', host)}"

    def cmd_rank(self, job: str, rank: int) -> str:
        return f"{self._job(job)}.cmd.rank.{check_rank(rank)}"

    def ack(self, job: str, issuer: str) -> str:
        return f"{self._job(job)}.ack.{check_token('issuer', issuer)}"

    def rpc(self, job: str, name: str) -> str:
        """The coordinator's request/reply endpoints (bodies in :mod:`trainguard.contract.rpc`)."""
        return f"{self._job(job)}.rpc.{check_token('rpc name', name)}"

    def rpc_resume(self, job: str) -> str:
        return self.rpc(job, "resume")

    def rpc_save(self, job: str) -> str:
        return self.rpc(job, "save")

    def rpc_rollback(self, job: str) -> str:
        return self.rpc(job, "rollback")

    def rpc_catalogue(self, job: str) -> str:
        return self.rpc(job, "checkpoints")

    def rpc_of_host(self, job: str, name: str, host: str) -> str:
        """An endpoint the agent of ``host`` asks on for itself (``jwt`` mode): the host is
        the subject's, so a credential that may publish only its own host's names it."""
        return f"{self.rpc(job, name)}.{check_token('host', host)}"

    def rpc_creds(self, job: str, host: str) -> str:
        """Where the agent of ``host`` asks the issuer for its ranks' credentials."""
        return self.rpc_of_host(job, "creds", host)

    def rpc_consumer(self, job: str, host: str) -> str:
        """Where the agent of ``host`` asks the control plane for its command consumer."""
        return self.rpc_of_host(job, "consumer", host)

    def host_of_rpc(self, subject: str, name: str) -> str | None:
        """The host of an ``rpc.<name>.<host>`` subject, or None for any other subject."""
        try:
            parsed = self.parse(subject)
        except InvalidToken:
            return None
        if parsed.kind != "rpc" or len(parsed.rest) != 2 or parsed.rest[0] != name:
            return None
        return parsed.rest[1]

    def dead(self, job: str) -> str:
        return f"{self._job(job)}.dead"

    def presence(self, role: str, name: str) -> str:
        """The subject a live ``role`` process named ``name`` (a detector's instance name,
        a remediator's lease token) answers on, as long as its NATS connection lives:
        'no responders' to a request there is the server's word that it is gone. The name
        goes in as a digest (a detector's may hold ``:``)."""
        digest = hashlib.blake2b(name.encode(), digest_size=8).hexdigest()
        return f"{self.prefix}.{PRESENCE}.{check_token('role', role)}.{digest}"

    def presence_pattern(self) -> str:
        return f"{self.prefix}.{PRESENCE}.>"

    # -- wildcards for subscriptions and stream capture ------------------------------
    def pattern(self, kind: str, job: str = "*", tail: str = "*") -> str:
        """A subscription pattern such as ``tg.*.hb.*`` or ``tg.job1.event.>``."""
        job_token = job if job == "*" else check_token("job", job)
        return f"{self.prefix}.{job_token}.{kind}.{tail}"

    def dead_pattern(self, job: str = "*") -> str:
        job_token = job if job == "*" else check_token("job", job)
        return f"{self.prefix}.{job_token}.dead"

    # -- parsing ----------------------------------------------------------------------
    def parse(self, subject: str) -> ParsedSubject:
        """Split a subject into job, kind and the remaining tokens.

        Raises :class:`InvalidToken` for a subject outside this prefix.
        """
        parts = subject.split(".")
        head = parts[: self.depth]
        if ".".join(head) != self.prefix or len(parts) < self.depth + 2:
            raise InvalidToken("subject", subject, f"not a {self.prefix}.<job>.<kind> subject")
        return ParsedSubject(job=parts[self.depth], kind=parts[self.depth + 1],
                             rest=tuple(parts[self.depth + 2:]))

    def job_of(self, subject: str) -> str | None:
        """The job token of a subject, or None if it is not one of ours."""
        try:
            return self.parse(subject).job
        except InvalidToken:
            return None


@dataclass(frozen=True, slots=True)
class ParsedSubject:
    job: str
    kind: str
    rest: tuple[str, ...]

    @property
    def rank(self) -> int | None:
        """The rank of a per-rank subject (hb, step, fp, snap, ckpt, reg, cmd.rank)."""
        tail = self.rest[-1] if self.rest else ""
        return int(tail) if tail.isdigit() else None

    @property
    def host(self) -> str | None:
        """The host of a per-host subject (gpu, node, exit, cmd.host, reg.host-)."""
        if self.kind in ("gpu", "node", "exit", "fr") and self.rest:
            return self.rest[0]
        if self.kind == "cmd" and len(self.rest) == 2 and self.rest[0] == "host":
            return self.rest[1]
        if self.kind == "reg" and self.rest and self.rest[0].startswith(NODE_REG_PREFIX):
            return self.rest[0][len(NODE_REG_PREFIX):]
        return None


# -- JetStream names derived from the prefix (two deployments can share one server) -------
StreamRole = Literal["events", "cmds", "reports", "dead", "telemetry"]


def stream_name(prefix: str, role: StreamRole) -> str:
    base = re.sub(r"[^A-Za-z0-9]", "_", prefix).upper()
    suffix = {"events": "EVENTS", "cmds": "CMDS", "reports": "REPORTS", "dead": "DEAD",
              "telemetry": "TEL"}[role]
    return f"{base}_{suffix}"


def bucket_name(prefix: str) -> str:
    """The fencing bucket of a deployment (``tg`` -> ``TG_FENCE``; stream ``KV_TG_FENCE``)."""
    return re.sub(r"[^A-Za-z0-9]", "_", prefix).upper() + "_FENCE"
