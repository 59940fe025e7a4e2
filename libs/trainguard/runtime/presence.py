"""Whether another service process is still connected to NATS: its presence subject.

A lease outlives its holder by up to its TTL, which is chosen long enough to ride out a
Redis failover (the holder keeps acting meanwhile by its own clock). A holder killed
outright leaves its lease behind for that long, and whatever it held unwatched. Its NATS
connection, though, ends with its process: each holder subscribes to its presence subject
(:meth:`~trainguard.contract.subjects.Subjects.presence`), and a request there that the
server answers with 'no responders' (within a round trip) says that no process of that
name is connected. That, seen ``confirm`` times in a row (a reconnecting process's
subscription may be missing for an instant), lets a peer take the lease over at once
(``LeaseHolder.take_from``). Nobody answers the request (only the coordinator may answer
requests, ``trainguard.core.auth``): while the holder listens, the request times out.

A process cut off from NATS but not from Redis also reads as gone: it hears no telemetry
and commands nobody meanwhile, so its jobs are better watched by a peer that does; the
lease it then fails to renew tells it to let them go.
"""

from __future__ import annotations

import contextlib
from typing import Any

import nats.errors

from trainguard.contract.subjects import Subjects
from trainguard.core.connection import flush


class Presence:
    """Serve this process's presence and ask after others' (one role's processes)."""

    def __init__(self, nc: Any, subjects: Subjects, role: str, timeout: float = 0.2,
                 confirm: int = 2) -> None:
        self.nc, self.subjects, self.role = nc, subjects, role
        self.timeout, self.confirm = timeout, confirm
        self._absent: dict[str, int] = {}
        self._served: dict[str, Any] = {}

    async def serve(self, name: str) -> None:
        """Listen on ``name``'s presence subject until :meth:`close` or the connection's end
        (the server knows the subscription once this returns)."""
        if name in self._served:
            return

        async def heard(msg: Any) -> None:
            """A peer asking: being subscribed is the whole answer."""

        self._served[name] = await self.nc.subscribe(self.subjects.presence(self.role, name),
                                                     cb=heard)
        await flush(self.nc)

    async def absent(self, name: str) -> bool:
        """Ask whether ``name`` is connected; True once the server has said 'no responders'
        ``confirm`` times in a row. A timeout (someone listens) or a bus error count as
        present: only the server's positive word that nobody listens counts as absence."""
        try:
            await self.nc.request(self.subjects.presence(self.role, name), b"",
                                  timeout=self.timeout)
        except nats.errors.NoRespondersError:
            self._absent[name] = self._absent.get(name, 0) + 1
            return self._absent[name] >= self.confirm
        except Exception:  # a timeout, a reconnect: nothing is known
            pass
        self._absent.pop(name, None)
        return False

    def forget(self, name: str) -> None:
        """Start counting ``name``'s absence over (it was acted on)."""
        self._absent.pop(name, None)

    async def close(self) -> None:
        for sub in self._served.values():
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._served.clear()
