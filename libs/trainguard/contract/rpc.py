"""The coordinator's request/reply endpoints: one :class:`Endpoint` each, with its bodies.

Every caller (remediator, agent, Guard, CLI) and the coordinator itself use these Structs,
so both sides of a call read and write the same fields. Requests tolerate unknown fields:
a newer caller that adds one still gets an answer from an older coordinator instead of a
``bad_request``.

``resume`` answers with a bare :class:`~trainguard.contract.schemas.ResumePoint` (the same JSON as
the ``LATEST`` file beside the checkpoints) or an empty payload when there is none. The
other endpoints answer with their reply Struct; an empty request means all defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Generic, Literal, Protocol, TypeVar

import msgspec

from .codec import decode_durable
from .errors import DecodeError
from .schemas import ResumePoint
from .subjects import Subjects

SaveStatus = Literal["committed", "suspect", "failed", "timeout", "abandoned", "bad_request",
                     "error"]
"""``abandoned``: a rank the save needs is known dead or frozen, so it cannot complete."""


class ResumeRequest(msgspec.Struct, kw_only=True):
    """Who asks for the resume point (for the coordinator's logs; the answer is per job)."""

    rank: int | None = None
    requester: str = ""
    below_step: int | None = None
    """Ask for the newest committed, trusted checkpoint below this step instead of the
    pointer (a rank that could not load the pointer's falls back; the pointer stays)."""


class SaveRequest(msgspec.Struct, kw_only=True):
    deadline: float | None = None
    """Seconds to wait for the commit; default: the ``save_deadline`` setting."""
    reason: str = ""
    blocking: bool = False
    """Ask ranks for a blocking save (for a process about to be stopped)."""


class SaveReply(msgspec.Struct, kw_only=True):
    ok: bool
    job: str
    status: SaveStatus
    step: int | None = None
    path: str = ""
    checkpoint_id: str = ""
    reason: str = ""
    missing_ranks: list[int] = []
    """Ranks that did not report the checkpoint."""
    failed_ranks: list[int] = []
    """Ranks that reported a failed save or files that do not verify."""
    command_ids: list[str] = []
    elapsed: float = 0.0


class RollbackRequest(msgspec.Struct, kw_only=True):
    below_step: int
    reason: str = ""


class RollbackReply(msgspec.Struct, kw_only=True):
    ok: bool
    job: str
    point: ResumePoint | None = None
    step: int | None = None
    suspect_steps: list[int] = []
    """Checkpoints at or above ``below_step`` that the rollback marked suspect."""
    reason: str = ""
    memory_step: int | None = None
    """No checkpoint on disk below ``below_step`` (``step`` None; a failure before the
    first save, say), but every rank holds a memory snapshot below it, the newest at most
    this step: a ``reload`` in place from memory only (its ``step`` :data:`MEMORY_ONLY`)."""


MEMORY_ONLY: Final = -1
"""A ``reload``'s ``step`` when no checkpoint on disk backs it: the ranks restore the newest
memory snapshot below its ``below`` that every rank holds, or fail (nothing to go back to)."""


class CatalogueRequest(msgspec.Struct, kw_only=True):
    limit: int = 100


class MemorySummary(msgspec.Struct, kw_only=True):
    """The ranks' memory snapshots as the coordinator last heard of them (each rank's
    newest :class:`~trainguard.contract.schemas.SnapshotReport`, still fresh)."""

    newest_step: int
    """The newest step every rank holds: the lowest of the ranks' newest."""
    oldest_step: int
    """The oldest step kept: the highest of the ranks' oldest (every rank holds one as old
    or older)."""
    taken: float = 0.0
    """When the snapshot of ``newest_step`` was taken (the earliest of the ranks' clocks)."""
    age: float = 0.0
    """Seconds from ``taken`` to the reply."""
    oldest_taken: float = 0.0
    """When the snapshot of ``oldest_step`` was taken."""
    oldest_age: float = 0.0
    """Seconds from ``oldest_taken`` to the reply: how far back in time memory reaches."""
    host_bytes: int = 0
    """Host memory the kept snapshots hold, on the rank that holds the most."""
    bytes: int = 0
    """One snapshot's size, on the rank with the largest share of the state."""
    copy_seconds: float = 0.0
    """The copy's cost to the training loop, on the slowest rank."""
    check_seconds: float = 0.0
    every: int = 0
    """Steps between snapshots (the most of any rank)."""
    ranks: list[int] = []
    """The ranks that reported."""
    world_size: int = 0
    """The job's size as the newest report says (0: not told)."""
    buddy_step: int = -1
    """The newest step whose copy every rank's buddy acknowledged (-1: some rank has none:
    a lost rank's shard is not in memory elsewhere)."""
    buddy_bytes: int = 0
    """Host memory the copies held for buddies take, on the rank that holds the most."""


class CatalogueReply(msgspec.Struct, kw_only=True):
    job: str
    pointer: ResumePoint | None = None
    pin: int | None = None
    interval: dict[str, Any] | None = None
    onsets: dict[str, Any] = {}
    checkpoints: list[dict[str, Any]] = []
    memory: MemorySummary | None = None
    """The ranks' memory snapshots (None: no rank reported one lately)."""
    reason: str = ""
    """Set when the coordinator could not answer (an error, not an empty catalogue)."""


class RankCredentialsRequest(msgspec.Struct, kw_only=True):
    """An agent asks for its ranks' credentials: each rank's user public key (``U...``),
    made on the agent's host; the seed never travels. The job and the host are the
    subject's (``rpc.creds.<host>``), which the agent's own credential confines it to;
    ``host`` must name the same host."""

    host: str
    keys: dict[int, str]
    """Rank -> the public key its credential is for."""
    replaces: list[str] = []
    """The JWTs of this host's credentials the new ones replace (a process renumbered in
    place, a local rank restarted under another number): revoked once these are issued."""


class RankCredentialsReply(msgspec.Struct, kw_only=True):
    ok: bool
    jwts: dict[int, str] = {}
    """Rank -> its user JWT (permissions for that rank of the job, an expiry)."""
    expires: float = 0.0
    reason: str = ""


class CommandConsumerRequest(msgspec.Struct, kw_only=True):
    """An agent asks the control plane to create (or update) its durable command consumer
    (``jwt`` mode: its own credential may bind, read and pull it, never create it, since
    a consumer's filter subjects are the request's body, which a permission cannot
    name). The job and the host are the subject's; ``host`` must name the same host."""

    host: str


class CommandConsumerReply(msgspec.Struct, kw_only=True):
    ok: bool
    stream: str = ""
    durable: str = ""
    """The consumer the agent binds (``agent-<job>-<host>`` on the command stream)."""
    reason: str = ""


Req = TypeVar("Req", bound=msgspec.Struct)
Rep = TypeVar("Rep", bound=msgspec.Struct)


@dataclass(frozen=True, slots=True)
class Endpoint(Generic[Req, Rep]):
    """One request/reply endpoint: its subject token and the two bodies."""

    name: str
    request: type[Req]
    reply: type[Rep]

    def subject(self, subjects: Subjects, job: str) -> str:
        return subjects.rpc(job, self.name)

    def encode_request(self, req: Req) -> bytes:
        return msgspec.json.encode(req)

    def decode_request(self, data: bytes) -> Req:
        """An empty payload is an all-defaults request; raises :class:`DecodeError`."""
        try:
            return msgspec.json.decode(data or b"{}", type=self.request)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise DecodeError(f"bad {self.name} request: {exc}") from None

    def encode_reply(self, reply: Rep) -> bytes:
        return msgspec.json.encode(reply)

    def decode_reply(self, data: bytes) -> Rep:
        """Raises :class:`DecodeError` for an unreadable or empty reply."""
        try:
            return msgspec.json.decode(data, type=self.reply)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise DecodeError(f"bad {self.name} reply: {exc}") from None


RESUME: Endpoint[ResumeRequest, ResumePoint] = Endpoint("resume", ResumeRequest, ResumePoint)
SAVE: Endpoint[SaveRequest, SaveReply] = Endpoint("save", SaveRequest, SaveReply)
ROLLBACK: Endpoint[RollbackRequest, RollbackReply] = Endpoint(
    "rollback", RollbackRequest, RollbackReply)
CATALOGUE: Endpoint[CatalogueRequest, CatalogueReply] = Endpoint(
    "checkpoints", CatalogueRequest, CatalogueReply)
ENDPOINTS: tuple[Endpoint[Any, Any], ...] = (RESUME, SAVE, ROLLBACK, CATALOGUE)
CREDS: Endpoint[RankCredentialsRequest, RankCredentialsReply] = Endpoint(
    "creds", RankCredentialsRequest, RankCredentialsReply)
"""Answered by the control plane's credential issuer (``jwt`` mode), not the coordinator,
on ``rpc.creds.<host>`` (:meth:`~trainguard.contract.subjects.Subjects.rpc_creds`)."""

CONSUMER: Endpoint[CommandConsumerRequest, CommandConsumerReply] = Endpoint(
    "consumer", CommandConsumerRequest, CommandConsumerReply)
"""Answered by the control plane's issuer (``jwt`` mode) on ``rpc.consumer.<host>``
(:meth:`~trainguard.contract.subjects.Subjects.rpc_consumer`)."""


class Requester(Protocol):
    """What :func:`call` needs of a connection (``nats.aio.client.Client`` is one)."""

    async def request(self, subject: str, payload: bytes = ..., timeout: float = ...,
                      ) -> Any: ...


async def call(nc: Requester, subjects: Subjects, job: str, endpoint: Endpoint[Req, Rep],
               req: Req, timeout: float) -> Rep | None:
    """One request; the typed reply, or None for an empty one (``resume``: no checkpoint).

    The connection's errors (no responders, timeout) propagate for the caller to word;
    an unreadable reply raises :class:`DecodeError`.
    """
    reply = await nc.request(endpoint.subject(subjects, job), endpoint.encode_request(req),
                             timeout=timeout)
    return endpoint.decode_reply(reply.data) if reply.data else None


def error_reply(name: str, job: str, reason: str) -> bytes:
    """What an endpoint answers when the coordinator fails: the endpoint's own reply with
    the reason (``resume``: empty, which a rank reads as "ask LATEST")."""
    match name:
        case "save":
            return SAVE.encode_reply(SaveReply(ok=False, job=job, status="error",
                                               reason=reason))
        case "rollback":
            return ROLLBACK.encode_reply(RollbackReply(ok=False, job=job, reason=reason))
        case "checkpoints":
            return CATALOGUE.encode_reply(CatalogueReply(job=job, reason=reason))
    return b""


def decode_resume(data: bytes | None) -> ResumePoint | None:
    """The resume endpoint's answer: None for an empty payload (no checkpoint yet).

    Raises :class:`DecodeError` for a malformed one.
    """
    if not data:
        return None
    return decode_durable(data, ResumePoint)
