"""The Guard's background thread: its own asyncio loop and NATS connection.

The training thread never waits on the bus. It appends to bounded deques (~0.05 µs,
oldest dropped when full) and this thread drains them every ``flush_interval``. Telemetry
is fire-and-forget on core NATS; durable messages (hello, acks, checkpoint reports) are
retried until JetStream acknowledges them, within a bounded outbox. If NATS is down at
start, the thread keeps trying to connect while the buffers fill and overflow (counted as
drops); nothing here raises into training.

nats-py (~0.1 s of imports: its JetStream, object store and ``email`` modules) is imported
on this thread, never by ``import trainguard``: a rank pays for it while its process group
forms, and a disabled Guard never pays at all.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trainguard.contract.codec import check_wire_size, encode_durable, encode_telemetry
from trainguard.contract.envelope import make_headers
from trainguard.contract.schemas import Durable, TelemetryMessage
from trainguard.core import tracing
from trainguard.core.connection import connect_options, flush

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.aio.msg import Msg

log = logging.getLogger("trainguard.client")

MessageCallback = Callable[["Msg"], None]


@dataclass
class TransportStats:
    """Counters the Guard reports (``dropped`` also travels in every heartbeat)."""

    sent: int = 0
    dropped: int = 0
    durable_sent: int = 0
    durable_dropped: int = 0
    durable_refused: int = 0
    """Durable messages dropped because they can never be sent (over the size limit, or
    not encodable); also counted in ``durable_dropped``."""
    callback_errors: int = 0
    """Exceptions raised by subscription callbacks (the subscription went on)."""
    connects: int = 0
    connect_failures: int = 0
    """First-connect attempts that failed (refused, timed out): the bus is down or slow."""
    renewals: int = 0
    """Switches to a new connection made with a rewritten (renewed) credential file."""
    errors: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Outgoing:
    """A durable message with its headers fixed at enqueue time, so every retry carries
    the same ``Nats-Msg-Id`` and JetStream drops the copies of one that did arrive."""

    subject: str
    msg: Durable
    headers: dict[str, str]


class Transport:
    """Owns the loop thread, the connection, the buffers and the subscriptions."""

    def __init__(
        self,
        url: str,
        *,
        name: str,
        source: str,
        buffer_size: int = 10_000,
        durable_buffer: int = 1_000,
        flush_interval: float = 0.05,
        connect_timeout: float = 2.0,
        pending_size: int = 2 * 1024 * 1024,
        access: Mapping[str, Any] | None = None,
    ) -> None:
        self.url = url
        self.name = name
        self.source = source
        self.flush_interval = flush_interval
        self.connect_timeout = connect_timeout
        self.pending_size = pending_size
        self.access = dict(access or {})
        """Credentials and TLS (:meth:`trainguard.core.auth.Access.nats_options`)."""
        self.stats = TransportStats()
        self.telemetry: collections.deque[tuple[str, TelemetryMessage]] = collections.deque(
            maxlen=buffer_size)
        self.durable: collections.deque[Outgoing] = collections.deque(maxlen=durable_buffer)
        self._subscriptions: list[tuple[str, MessageCallback]] = []
        self._subscribed = 0
        """How many of ``_subscriptions`` are made."""
        self._periodic: list[tuple[float, Callable[[], None]]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._nc: NATS | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._linger = 0.0
        self._creds_stamp: int | None = None
        """When the credential file in use was written (a rewrite is a renewal)."""

    # -- called from the training thread ------------------------------------------------
    def publish(self, subject: str, msg: TelemetryMessage) -> None:
        """Queue telemetry; when the buffer is full the oldest message is dropped."""
        q = self.telemetry
        if len(q) == q.maxlen:
            self.stats.dropped += 1
        q.append((subject, msg))

    def publish_durable(self, subject: str, msg: Durable,
                        traceparent: str | None = None) -> None:
        """Queue a JetStream message; ``traceparent`` continues a trace (else the current)."""
        headers = make_headers(msg, source=self.source, subject=subject)
        if traceparent:
            headers["traceparent"] = traceparent
        else:
            tracing.inject(headers)
        q = self.durable
        if len(q) == q.maxlen:
            self.stats.durable_dropped += 1
        q.append(Outgoing(subject, msg, headers))

    def subscribe(self, subject: str, callback: MessageCallback) -> None:
        """Register a core subscription: made once connected, at once when it already is
        (a rank renumbered in place listens on its new subject).

        ``callback`` runs on the transport thread and must only hand work over.
        """
        self._subscriptions.append((subject, callback))
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop ended meanwhile
                asyncio.run_coroutine_threadsafe(self._subscribe_live(), loop)

    def every(self, seconds: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the transport thread every ``seconds`` (e.g. the heartbeat)."""
        self._periodic.append((seconds, fn))

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=f"trainguard-{self.name}",
                                        daemon=True)
        self._thread.start()
        self._started.wait(5.0)

    def request(self, subject: str, payload: bytes, timeout: float) -> bytes | None:
        """A NATS request from the training thread, bounded by ``timeout``; None on failure."""
        loop, nc = self._loop, self._nc
        if loop is None or nc is None or not nc.is_connected:
            return None

        async def _req() -> bytes:
            reply = await nc.request(subject, payload, timeout=timeout)
            return bytes(reply.data)

        try:
            return asyncio.run_coroutine_threadsafe(_req(), loop).result(timeout + 0.5)
        except Exception as exc:
            log.debug("request %s failed: %r", subject, exc)
            return None

    def close(self, timeout: float = 5.0) -> None:
        """Flush what is queued (bounded by ``timeout``) and stop the thread."""
        loop, stop, thread = self._loop, self._stop, self._thread
        if thread is None or loop is None or stop is None:
            return
        self._linger = timeout / 2
        with contextlib.suppress(RuntimeError):  # loop already closed
            loop.call_soon_threadsafe(stop.set)
        thread.join(timeout)
        self._thread = None

    @property
    def connected(self) -> bool:
        """Connected, with the subscriptions made (they are made before this turns true)."""
        nc = self._nc
        return bool(nc is not None and nc.is_connected)

    def wait_connected(self, deadline: float, *, until_failure: bool = False) -> bool:
        """Wait until :attr:`connected` or ``deadline`` (monotonic); with ``until_failure``
        not past a failed connect attempt either (a refused connect is a bus that is down).
        Returns :attr:`connected`."""
        while not self.connected and time.monotonic() < deadline \
                and not (until_failure and self.stats.connect_failures):
            time.sleep(0.005)
        return self.connected

    # -- the transport thread ---------------------------------------------------------
    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        except Exception:  # the thread must never take the training process down
            log.exception("trainguard transport stopped")
        finally:
            with contextlib.suppress(Exception):
                # Let cancelled work (a connect in flight) unwind before the loop closes.
                leftover = asyncio.all_tasks(loop)
                for task in leftover:
                    task.cancel()
                if leftover:
                    loop.run_until_complete(asyncio.wait(leftover, timeout=2.0))
                loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        self._started.set()
        periodic = [asyncio.create_task(self._tick(s, fn)) for s, fn in self._periodic]
        connector = asyncio.create_task(self._connect_forever())
        try:
            while not self._stop.is_set():
                if self._ended_by_server() or (self._nc is None and connector.done()):
                    # Also a connector that ended without a connection: nats-py's connect
                    # can end cancelled from within when the server drops it mid-handshake.
                    connector = asyncio.create_task(self._connect_forever())
                await self._renew()
                await self._drain()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.flush_interval)
            for task in periodic:
                task.cancel()
            if self._nc is None and not self.stats.connect_failures:
                # Closed while the first connect is still under way (a short job on a busy
                # machine): let that attempt finish, within half of close's bound, so what
                # is queued still goes out. A bus that refused us is not waited for.
                await asyncio.wait({connector}, timeout=self._linger)
            # Final flush: whatever is queued gets one chance to go out.
            await self._drain()
            if self._nc is not None and self._nc.is_connected:
                with contextlib.suppress(Exception):
                    await flush(self._nc, 2.0)
        finally:
            connector.cancel()
            for task in periodic:
                task.cancel()
            # Let cancelled tasks unwind (a connect attempt in flight), bounded.
            await asyncio.wait([connector, *periodic], timeout=1.0)
            if self._nc is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._nc.close(), 2.0)

    async def _tick(self, seconds: float, fn: Callable[[], None]) -> None:
        while True:
            try:
                fn()
            except Exception:
                log.debug("periodic job failed", exc_info=True)
            await asyncio.sleep(seconds)

    def _ended_by_server(self) -> bool:
        """The connection is closed for good though nobody here closed it: the server
        ended it with an auth error (an expired credential), after which nats-py does not
        reconnect. The next connect reads the credential file again (a renewed one); what
        is queued meanwhile waits in the buffers, subscriptions are made anew."""
        nc = self._nc
        if nc is None or not nc.is_closed:
            return False
        self.stats.errors["ended_by_server"] = self.stats.errors.get("ended_by_server", 0) + 1
        self._nc = None
        self._subscribed = 0
        return True

    async def _connect_forever(self) -> None:
        """First connect with a bound, retried until it works; then NATS reconnects itself."""
        assert self._stop is not None
        while not self._stop.is_set():
            nc = await self._open()
            if nc is None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), 1.0)
                continue
            await self._subscribe_new(nc)
            self._nc = nc
            self.stats.connects += 1
            return

    async def _open(self) -> NATS | None:
        """One connect attempt (reading the credential file as it is now); None if it
        failed (counted)."""
        from nats.aio.client import Client as NATS

        nc = NATS()

        async def _error_cb(exc: Exception) -> None:
            key = type(exc).__name__
            self.stats.errors[key] = self.stats.errors.get(key, 0) + 1

        async def _reconnected_cb() -> None:
            self.stats.connects += 1

        self._creds_stamp = self._credential_stamp()
        try:
            options = connect_options(self.url, name=self.name,
                                      connect_timeout=self.connect_timeout,
                                      error_cb=_error_cb, reconnected_cb=_reconnected_cb,
                                      pending_size=self.pending_size)
            options.update(self.access)
            await asyncio.wait_for(nc.connect(**options), self.connect_timeout * 2)
        except asyncio.CancelledError:
            # Closed while connecting (to a frozen server, say): close the half-open
            # socket too, or it outlives the Guard.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 1.0)
            raise
        except Exception:
            self.stats.connect_failures += 1
            with contextlib.suppress(Exception):
                await nc.close()
            return None
        return nc

    def _credential_stamp(self) -> int | None:
        """When the ``.creds`` file in use was last written (None: no such file)."""
        # trainguard.core.credsfile.CredsFile's callbacks (not imported: it loads nkeys).
        path = getattr(getattr(self.access.get("user_jwt_cb"), "__self__", None), "path", None)
        try:
            return os.stat(path).st_mtime_ns if path else None
        except OSError:
            return None

    async def _renew(self) -> None:
        """The credential file was rewritten (renewed before it expires): connect with the
        new one, subscribe, switch over, then drain the old connection, so nothing
        published is lost. A failed connect keeps the old one and tries at the next
        rewrite."""
        old = self._nc
        stamp = self._credential_stamp()
        if old is None or stamp is None or stamp == self._creds_stamp or not old.is_connected:
            return
        new = await self._open()
        if new is None:
            return
        saved, self._subscribed = self._subscribed, 0
        try:
            await self._subscribe_new(new)
        except Exception:
            self._subscribed = saved
            with contextlib.suppress(Exception):
                await new.close()
            return
        self._nc = new
        self.stats.renewals += 1
        with contextlib.suppress(Exception):
            await asyncio.wait_for(old.drain(), 5.0)

    async def _subscribe_new(self, nc: NATS) -> None:
        """Make the registered subscriptions not made yet (on the transport thread only:
        the connect and a later :meth:`subscribe` never make one twice)."""
        while self._subscribed < len(self._subscriptions):
            subject, cb = self._subscriptions[self._subscribed]
            await nc.subscribe(subject, cb=self._wrap(cb))
            self._subscribed += 1

    async def _subscribe_live(self) -> None:
        if self._nc is None:
            return  # still connecting: the connect makes it
        try:
            await self._subscribe_new(self._nc)
        except Exception as exc:
            log.warning("subscribing failed: %r", exc)

    def _wrap(self, cb: MessageCallback) -> Callable[[Msg], Any]:
        """``cb`` with each message isolated: an exception is counted and logged (the first
        few at warning, so a flood of junk cannot flood a trainer's log)."""

        async def _cb(msg: Msg) -> None:
            try:
                cb(msg)
            except Exception:
                self.stats.callback_errors += 1
                level = logging.WARNING if self.stats.callback_errors <= 10 else logging.DEBUG
                log.log(level, "subscription callback failed on %s", msg.subject,
                        exc_info=True)

        return _cb

    async def _drain(self) -> None:
        nc = self._nc
        if nc is None or not nc.is_connected:
            return
        from nats.errors import OutboundBufferLimitError  # loaded with the client already

        q = self.telemetry
        while q:
            subject, msg = q.popleft()
            try:
                await nc.publish(subject, encode_telemetry(msg))
                self.stats.sent += 1
            except OutboundBufferLimitError:
                self.stats.dropped += 1
            except Exception:
                self.stats.dropped += 1
        js = nc.jetstream(timeout=2.0)
        dq = self.durable
        while dq and nc.is_connected:
            item = dq[0]
            try:
                body = encode_durable(item.msg)
                check_wire_size(f"{item.msg.KIND} on {item.subject}", body, item.headers,
                                nc.max_payload)
            except Exception as exc:  # it never goes out: kept, it would stall all after it
                dq.popleft()
                self.stats.durable_refused += 1
                self.stats.durable_dropped += 1
                log.warning("dropped a durable message to %s: %s", item.subject, exc)
                continue
            try:
                # js.publish mutates the dict it gets: hand it a copy.
                await js.publish(item.subject, body, headers=dict(item.headers))
            except Exception as exc:
                log.debug("durable publish to %s failed: %r", item.subject, exc)
                return
            dq.popleft()
            self.stats.durable_sent += 1

