"""Each local rank's own NATS credential, obtained from the control plane and renewed.

In ``jwt`` mode the agent makes a user nkey per rank on its host, asks the control
plane's issuer (``rpc.creds.<host>`` of its job and host, :mod:`trainguard.runtime.issuer`)
for a JWT per public key, and writes ``<dir>/rank-<R>.creds`` (mode 0600), the file that rank's
environment names (``rank-{rank}.creds``: :data:`trainguard.agent.supervisor.RANK_FIELD`).
Before the credentials expire it asks again and rewrites the files; each rank's Guard
switches to a connection made with its rewritten file (:mod:`trainguard.client.transport`).
The agent's own credential and its secret never reach a rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trainguard.contract.errors import TrainguardError
from trainguard.contract.rpc import CREDS, RankCredentialsRequest
from trainguard.contract.subjects import Subjects
from trainguard.core.auth import write_private
from trainguard.core.natsjwt import Key, creds

RENEW_AT: float = 2 / 3
"""Renew once this share of a credential's life has passed."""


class CredentialsRefused(TrainguardError):
    """The issuer refused, or did not answer, a request for ranks' credentials."""


class RankCredentials:
    """The credential files of this host's ranks, under ``directory``."""

    def __init__(self, directory: Path, subjects: Subjects, job: str, host: str, *,
                 timeout: float = 5.0) -> None:
        self.directory = directory
        self.subjects = subjects
        self.job = job
        self.host = host
        self.timeout = timeout
        self.ranks: set[int] = set()
        self.issued = 0.0
        self.expires = 0.0

    def path(self, rank: int) -> Path:
        return self.directory / f"rank-{rank}.creds"

    @property
    def pattern(self) -> str:
        """What the ranks' environment names (``{rank}`` becomes each rank's number)."""
        return str(self.directory / "rank-{rank}.creds")

    async def obtain(self, nc: Any, ranks: Iterable[int]) -> float:
        """Credentials for ``ranks`` (new keys, new JWTs), written to their files;
        returns when they expire. Raises :class:`CredentialsRefused`."""
        keys = {r: Key.new("user") for r in sorted(set(ranks))}
        req = RankCredentialsRequest(host=self.host, keys={r: k.public for r, k in keys.items()})
        try:  # on its own host's subject, the only one its credential may ask on
            msg = await nc.request(self.subjects.rpc_creds(self.job, self.host),
                                   CREDS.encode_request(req), timeout=self.timeout)
            reply = CREDS.decode_reply(msg.data) if msg.data else None
        except Exception as exc:
            raise CredentialsRefused(f"no credentials for ranks {sorted(keys)} of "
                                     f"{self.job}: the issuer did not answer ({exc!r})"
                                     ) from None
        if reply is None or not reply.ok or set(reply.jwts) != set(keys):
            why = reply.reason if reply is not None else "an empty reply"
            raise CredentialsRefused(f"no credentials for ranks {sorted(keys)} of "
                                     f"{self.job}: {why}")
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        for rank, token in reply.jwts.items():
            write_private(self.path(rank), creds(token, keys[rank].seed))
        self.ranks |= set(keys)
        self.issued, self.expires = time.time(), reply.expires
        return reply.expires

    def renew_in(self, now: float | None = None) -> float:
        """Seconds until the files should be renewed (0: now)."""
        now = time.time() if now is None else now
        return max(0.0, self.issued + (self.expires - self.issued) * RENEW_AT - now)

    async def renew_forever(self, nc: Any, stop: asyncio.Event, retry: float = 5.0) -> None:
        """Rewrite every rank's file before it expires, until ``stop``; a refused renewal
        is retried every ``retry`` seconds (the old files serve until they expire)."""
        while not stop.is_set():
            wait = self.renew_in() if self.ranks else retry
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)
            if stop.is_set() or not self.ranks:
                continue
            try:
                await self.obtain(nc, self.ranks)
            except CredentialsRefused as exc:  # past the renewal time: the next try waits
                print(f"trainguard launch: renewing rank credentials: {exc}", flush=True)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), retry)
