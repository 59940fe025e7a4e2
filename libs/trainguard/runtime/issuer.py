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
"""

from __future__ import annotations

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from trainguard.contract.errors import DecodeError
from trainguard.contract.rpc import CREDS, RankCredentialsReply
from trainguard.contract.subjects import Subjects
from trainguard.core.connection import flush
from trainguard.core.identities import Minter

from .logs import get_logger

log = get_logger("trainguard.runtime.issuer")


async def serve_issuer(nc: NATS, minter: Minter, prefix: str, *, ttl: float,
                       limit: int = 4096) -> Subscription:
    """Answer ``rpc.creds.<host>`` of every job on ``nc`` (a queue group: replicas share
    the work); the server knows the subscription once this returns."""
    subjects = Subjects(prefix)

    async def on_request(msg: Msg) -> None:
        job = subjects.job_of(msg.subject) or ""
        host = subjects.host_of_creds(msg.subject) or ""
        try:
            req = CREDS.decode_request(msg.data)
            reply = minter.issue(prefix, job, host, req, ttl, limit)
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

    sub: Subscription = await nc.subscribe(subjects.pattern("rpc", tail=f"{CREDS.name}.*"),
                                           queue="issuer", cb=on_request)
    await flush(nc)
    return sub
