"""The credential issuer: the one control-plane endpoint that mints ranks' credentials.

In ``jwt`` mode the agent of host ``H`` asks on ``<prefix>.<job>.rpc.creds.<H>`` for its
ranks' credentials, sending each rank's user public key
(:class:`~trainguard.contract.rpc.RankCredentialsRequest`); the issuer answers with a
short-lived JWT per rank (:meth:`Minter.issue`). The job and the host are the subject's,
and the server lets an agent's credential publish only its own job's and host's
``rpc.creds.<host>``: no agent obtains another job's ranks, and every rank credential names
the host whose agent asked for it (logged here too). Which global rank numbers a host runs
is torch's rendezvous's, which the control plane does not take part in: an agent may still
ask for any rank number of its own job (docs/security.md). The issuer holds the account's
signing key; agents and ranks never do. A thin shell: the rule is :meth:`Minter.issue`.
The credentials an agent's ask replaces (a rank renumbered in place) are revoked before the
answer goes out (:meth:`Minter.replaced`, :func:`~trainguard.core.identities.revoke`).

It also creates an agent's durable command consumer when the agent asks on
``<prefix>.<job>.rpc.consumer.<H>``: the consumer of that job and host
(:func:`~trainguard.runtime.topology.agent_consumer`, filtered to ``cmd.all`` and
``cmd.host.<H>``), which the agent's own credential may bind and pull but not create.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from trainguard.contract.errors import DecodeError, InvalidToken, TrainguardError
from trainguard.contract.rpc import (
    CONSUMER,
    CREDS,
    CommandConsumerReply,
    CommandConsumerRequest,
    RankCredentialsReply,
)
from trainguard.contract.subjects import Subjects
from trainguard.core.connection import flush
from trainguard.core.identities import Minter

from .logs import get_logger
from .topology import agent_consumer, ensure_consumer

log = get_logger("trainguard.runtime.issuer")


Revoke = Callable[[Mapping[str, float | None]], Awaitable[None]]
"""Revokes user public keys (-> their credentials' expiry): :func:`identities.revoke`
on a system account connection."""


async def serve_issuer(nc: NATS, minter: Minter, prefix: str, *, ttl: float,
                       limit: int = 4096, revoke: Revoke | None = None) -> Subscription:
    """Answer ``rpc.creds.<host>`` and ``rpc.consumer.<host>`` of every job on ``nc`` (a
    queue group: replicas share the work); the server knows the subscriptions once this
    returns. The credentials a request replaces are revoked with ``revoke`` before the
    answer goes out (None: they live until they expire, which is logged)."""
    subjects = Subjects(prefix)

    async def on_request(msg: Msg) -> None:
        job = subjects.job_of(msg.subject) or ""
        host = subjects.host_of_rpc(msg.subject, CREDS.name) or ""
        try:
            req = CREDS.decode_request(msg.data)
            reply = minter.issue(prefix, job, host, req, ttl, limit)
            if reply.ok and req.replaces:
                await _revoke_replaced(minter.replaced(job, host, req), job, host, revoke)
        except DecodeError as exc:
            reply = RankCredentialsReply(ok=False, reason=exc.reason)
        except Exception as exc:  # one bad request must not end the endpoint
            log.exception("issuing credentials for %s failed", job)
            reply = RankCredentialsReply(ok=False, reason=f"issuer failed: {exc!r}")
        if not reply.ok:
            log.warning("refused credentials for job %s to host %s: %s", job, host,
                        reply.reason)
        else:
            log.info("issued credentials for ranks %s of job %s to host %s",
                     sorted(reply.jwts), job, host)
        await msg.respond(CREDS.encode_reply(reply))

    async def on_consumer(msg: Msg) -> None:
        job = subjects.job_of(msg.subject) or ""
        host = subjects.host_of_rpc(msg.subject, CONSUMER.name) or ""
        try:
            reply = await create_agent_consumer(js, prefix, job, host,
                                                CONSUMER.decode_request(msg.data))
        except DecodeError as exc:
            reply = CommandConsumerReply(ok=False, reason=exc.reason)
        except Exception as exc:  # one bad request must not end the endpoint
            log.warning("creating the command consumer of host %s of job %s failed: %r",
                        host, job, exc)
            reply = CommandConsumerReply(ok=False, reason=f"issuer failed: {exc!r}")
        if not reply.ok:
            log.warning("refused the command consumer of host %s of job %s: %s", host, job,
                        reply.reason)
        await msg.respond(CONSUMER.encode_reply(reply))

    js = nc.jetstream()
    sub: Subscription = await nc.subscribe(subjects.pattern("rpc", tail=f"{CREDS.name}.*"),
                                           queue="issuer", cb=on_request)
    await nc.subscribe(subjects.pattern("rpc", tail=f"{CONSUMER.name}.*"), queue="issuer",
                       cb=on_consumer)
    await flush(nc)
    return sub


async def _revoke_replaced(keys: Mapping[str, float | None], job: str, host: str,
                          revoke: Revoke | None) -> None:
    """Revoke the credentials new ones replaced; one that cannot be revoked is logged
    (the new ones stand: it expires at its end of life)."""
    if revoke is None:
        log.warning("credentials of job %s on host %s replaced but not revoked (no system "
                    "account connection): they live until they expire", job, host)
        return
    try:
        await revoke(keys)
    except TrainguardError as exc:
        log.warning("revoking replaced credentials of job %s on host %s failed: %s", job,
                    host, exc)
        return
    log.info("revoked %d replaced credential(s) of job %s on host %s", len(keys), job, host)


async def create_agent_consumer(js: JetStreamContext, prefix: str, job: str, host: str,
                                req: CommandConsumerRequest) -> CommandConsumerReply:
    """Create (or update) the command consumer of ``host``'s agent in ``job`` (both the
    subject's, which the agent's credential confines to its own); refused if the body
    names another host. The stream's own errors (not provisioned yet) propagate."""
    if req.host != host:
        return CommandConsumerReply(ok=False, reason=f"the request names host {req.host!r} "
                                                     f"on host {host!r}'s subject")
    try:
        spec = agent_consumer(prefix, job, host)
    except InvalidToken as exc:
        return CommandConsumerReply(ok=False, reason=str(exc))
    stream = await ensure_consumer(js, prefix, spec)
    return CommandConsumerReply(ok=True, stream=stream, durable=spec.durable)
