"""Each local rank's own NATS credential, obtained from the control plane and renewed.

In ``jwt`` mode the agent makes a user nkey per rank on its host, asks the control
plane's issuer (``rpc.creds.<host>`` of its job and host, :mod:`trainguard.runtime.issuer`)
for a JWT per public key, and writes ``<dir>/local-<L>.creds`` (mode 0600) for the process
of local rank ``L``, the file that process's environment names (``local-{local_rank}.creds``:
:data:`trainguard.agent.supervisor.LOCAL_FIELD`). Before the credentials expire it asks
again and rewrites the files; each rank's Guard switches to a connection made with its
rewritten file (:mod:`trainguard.client.transport`). The file is the process's, not the
number's: when an in-place re-form renumbers a process (:meth:`RankCredentials.renumber`),
or a restart gives its local rank another number, the agent obtains the new number's
credential and rewrites the same file, the Guard switches to it, and the old number's is
revoked by the issuer as it issues the new one (the server ends its connections). The
agent's own credential and its secret never reach a rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
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
    """The credential files of this host's ranks, under ``directory``, one per local rank."""

    def __init__(self, directory: Path, subjects: Subjects, job: str, host: str, *,
                 timeout: float = 5.0) -> None:
        self.directory = directory
        self.subjects = subjects
        self.job = job
        self.host = host
        self.timeout = timeout
        self.held: dict[int, int] = {}
        """Local rank -> the global rank number its file's credential is for."""
        self.due: dict[int, float] = {}
        """Local rank -> when its file should be renewed (Unix time)."""
        self.tokens: dict[int, str] = {}
        """Local rank -> the JWT its file holds (what a new number's credential replaces)."""
        self._lock = asyncio.Lock()  # a renewal's numbers are those held when it asks

    @property
    def ranks(self) -> set[int]:
        """The global rank numbers the files hold credentials for."""
        return set(self.held.values())

    def path(self, local_rank: int) -> Path:
        return self.directory / f"local-{local_rank}.creds"

    @property
    def pattern(self) -> str:
        """What the ranks' environment names (``{local_rank}`` becomes each process's)."""
        return str(self.directory / "local-{local_rank}.creds")

    async def obtain(self, nc: Any, ranks: Mapping[int, int]) -> float:
        """Credentials for ``ranks`` (local rank -> global rank; new keys, new JWTs),
        written to the local ranks' files; returns when they expire. Raises
        :class:`CredentialsRefused`."""
        async with self._lock:
            return await self._obtain(nc, ranks)

    async def renew(self, nc: Any) -> float | None:
        """New credentials for every file, for the numbers they hold (None: none held)."""
        async with self._lock:
            return await self._obtain(nc, dict(self.held)) if self.held else None

    async def _obtain(self, nc: Any, ranks: Mapping[int, int]) -> float:
        numbers = sorted(set(ranks.values()))
        if len(numbers) != len(ranks):
            raise CredentialsRefused(f"two local ranks of {dict(ranks)} share a number")
        keys = {r: Key.new("user") for r in numbers}
        # A file given another number, or a number taken from another file: the old
        # credential is revoked once the new one is issued.
        replaces = sorted({self.tokens[lo] for lo, r in self.held.items()
                           if ranks.get(lo, r) != r or (lo not in ranks and r in keys)})
        req = RankCredentialsRequest(host=self.host, keys={r: k.public for r, k in keys.items()},
                                     replaces=replaces)
        try:  # on its own host's subject, the only one its credential may ask on
            msg = await nc.request(self.subjects.rpc_creds(self.job, self.host),
                                   CREDS.encode_request(req), timeout=self.timeout)
            reply = CREDS.decode_reply(msg.data) if msg.data else None
        except Exception as exc:
            raise CredentialsRefused(f"no credentials for ranks {numbers} of "
                                     f"{self.job}: the issuer did not answer ({exc!r})"
                                     ) from None
        if reply is None or not reply.ok or set(reply.jwts) != set(keys):
            why = reply.reason if reply is not None else "an empty reply"
            raise CredentialsRefused(f"no credentials for ranks {numbers} of "
                                     f"{self.job}: {why}")
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        now = time.time()
        for local in [lo for lo, r in self.held.items() if r in keys and lo not in ranks]:
            del self.held[local], self.due[local], self.tokens[local]  # one process's: the newest
        for local, rank in ranks.items():
            write_private(self.path(local), creds(reply.jwts[rank], keys[rank].seed))
            self.tokens[local] = reply.jwts[rank]
            self.due[local] = now + (reply.expires - now) * RENEW_AT
        self.held.update(ranks)
        return reply.expires

    async def renumber(self, nc: Any, renumbered: Mapping[int, int]) -> float | None:
        """Processes renumbered in place (old global rank -> new): the new numbers'
        credentials, written over the same processes' files (their Guards switch to them);
        the old numbers' are revoked. None if none of them is held here. Raises
        :class:`CredentialsRefused`."""
        async with self._lock:
            moved = {local: renumbered[rank] for local, rank in self.held.items()
                     if rank in renumbered}
            return await self._obtain(nc, moved) if moved else None

    def renew_in(self, now: float | None = None) -> float:
        """Seconds until the first of the files should be renewed (0: now)."""
        now = time.time() if now is None else now
        return max(0.0, min(self.due.values(), default=now) - now)

    async def renew_forever(self, nc: Any, stop: asyncio.Event, retry: float = 5.0) -> None:
        """Rewrite every rank's file before it expires, until ``stop``; a refused renewal
        is retried every ``retry`` seconds (the old files serve until they expire)."""
        while not stop.is_set():
            wait = self.renew_in() if self.held else retry
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)
            if stop.is_set() or not self.held:
                continue
            try:
                await self.renew(nc)
            except CredentialsRefused as exc:  # past the renewal time: the next try waits
                print(f"trainguard launch: renewing rank credentials: {exc}", flush=True)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), retry)
