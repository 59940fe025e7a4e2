"""The agent's connection to the control plane, on a background thread.

The main thread belongs to the launcher's supervisor (it handles signals and polls its
workers), so NATS and Redis live on a thread with its own event loop. Order at start
matters: the durable command consumer exists *before* ``NodeHello`` goes out, because the
command stream has interest retention and drops commands nobody is bound to yet. The agent
creates it, or in ``jwt`` mode asks the control plane to (its own credential may bind and
pull it only).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import nats.errors

from trainguard.contract.codec import decode_as
from trainguard.contract.envelope import H_TYPE, normalize_headers
from trainguard.contract.errors import DecodeError, InvalidToken
from trainguard.contract.evidence import HostFacts
from trainguard.contract.rpc import (
    CONSUMER,
    SAVE,
    CommandConsumerRequest,
    SaveReply,
    SaveRequest,
    call,
)
from trainguard.contract.schemas import (
    Command,
    CommandAck,
    Durable,
    GpuSample,
    GpuStats,
    NodeHeartbeat,
    NodeHello,
    ProcessState,
    TelemetryMessage,
    XidEvent,
)
from trainguard.core import tracing
from trainguard.core.receiver import Unreadable
from trainguard.runtime.bus import Bus, BusUnavailable, connect_nats
from trainguard.runtime.deadletter import MAX_REASON, clip
from trainguard.runtime.fencing import Epochs
from trainguard.runtime.metrics import ErrorReason
from trainguard.runtime.settle import TRANSIENT_ERRORS, decode_reason, delivery_facts
from trainguard.runtime.state import Keys, read_blocklist_entry
from trainguard.runtime.store import redis_client
from trainguard.runtime.topology import (
    ConsumerSpec,
    agent_consumer,
    ensure_consumer,
    missing_streams,
    provision,
    streams,
)

from . import procs
from .executor import CommandExecutor
from .gpu import alarm
from .node import LocalNode
from .rankcreds import CredentialsRefused, RankCredentials
from .settings import AgentSettings

log = logging.getLogger("trainguard.agent")

OUTBOX_RETRY_S = 15.0
"""How long a report the ranks handed over (exits, recoveries) is retried while the bus is
away, before it is dropped with a warning."""


def consumer_spec(settings: AgentSettings) -> ConsumerSpec:
    return agent_consumer(settings.prefix, settings.job, settings.host)


class AgentLink:
    def __init__(self, settings: AgentSettings, node: LocalNode, hello: NodeHello) -> None:
        self.settings = settings
        self.node = node
        self.hello = hello
        self.executor = CommandExecutor(node)
        self._outbox: queue.SimpleQueue[tuple[str, Durable]] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._bus: Bus | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()
        self._gpu_seq = 0
        self._hb_seq = 0
        self.command_errors: collections.Counter[ErrorReason] = collections.Counter()
        """Exceptions the command loop caught and went on from, by reason."""
        self.rank_credentials: RankCredentials | None = None
        """``jwt`` mode: each local rank's own credential, obtained and renewed here."""

    # -- any thread ---------------------------------------------------------------------
    def publish(self, subject: str, msg: Durable) -> None:
        self._outbox.put((subject, msg))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="trainguard-agent-link",
                                        daemon=True)
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
        if self._thread is not None:
            self._thread.join(timeout)

    def call(self, fn: Callable[[], Any], timeout: float) -> Any:
        """Run a coroutine factory on the link's loop from another thread, bounded."""
        loop = self._loop
        if loop is None:
            return None
        try:
            return asyncio.run_coroutine_threadsafe(fn(), loop).result(timeout)
        except Exception as exc:
            log.debug("link call failed: %r", exc)
            return None

    def ensure_rank_credentials(self, local_rank: int, rank: int) -> None:
        """Obtain rank ``rank``'s own credential into local rank ``local_rank``'s file
        before that process starts, if the file does not hold it yet (from the supervisor's
        thread, bounded). One that cannot be had costs the rank its telemetry (the server
        refuses it), never its training: said, not raised."""
        rc = self.rank_credentials
        if rc is None or rc.held.get(local_rank) == rank:
            return

        async def _obtain() -> None:
            assert self._bus is not None
            await rc.obtain(self._bus.nc, {local_rank: rank})

        self.call(_obtain, rc.timeout + 1.0)
        if rc.held.get(local_rank) != rank:
            print(f"trainguard launch: warning: no credential for rank {rank} from the "
                  "control plane's issuer (is `trainguard up --auth jwt` running?); its "
                  "telemetry will be refused", flush=True)

    def renumber_rank_credentials(self, renumbered: dict[int, int]) -> None:
        """Local ranks renumbered in place (old global rank -> new, from the supervisor's
        thread, which it does not hold up): their files get the new numbers' credentials
        on the link's loop, and their Guards switch to them. One that cannot be had is
        said, not raised: the rank's telemetry under its new number is refused until its
        next restart."""
        rc, loop = self.rank_credentials, self._loop
        if rc is None or loop is None or not renumbered:
            return

        async def _renumber() -> None:
            assert self._bus is not None
            try:
                await rc.renumber(self._bus.nc, renumbered)
            except CredentialsRefused as exc:
                print(f"trainguard launch: warning: renumbered ranks {renumbered}: {exc}; "
                      "their telemetry under the new numbers will be refused", flush=True)

        with contextlib.suppress(RuntimeError):  # a closed loop: the link is gone
            asyncio.run_coroutine_threadsafe(_renumber(), loop)

    def request_save(self, deadline: float) -> str:
        """Ask the checkpoint coordinator for a save-now (preemption); bounded wait."""
        req = SaveRequest(deadline=deadline, reason="preemption")

        async def _req() -> SaveReply | None:
            assert self._bus is not None
            return await call(self._bus.nc, self.settings.subjects, self.settings.job, SAVE,
                              req, deadline)

        reply = self.call(_req, deadline + 1.0)
        if reply is None:
            return "no answer from the coordinator"
        return (f"saved step {reply.step}" if reply.ok
                else f"save-now {reply.status}: {reply.reason}")

    def _redis(self) -> Any:
        """A short-lived read-only client (the agent role may only read): one retry, so a
        Redis outage never holds up a command or the launch for long."""
        return redis_client(self.settings.redis_url, retries=1,
                            access=self.settings.access.redis_options())

    def blocklisted(self, timeout: float = 3.0) -> str | None:
        """The reason this host is on the remediator's blocklist, or None."""
        key = Keys(self.settings.prefix).blocklist()

        async def _get() -> str | None:
            client = self._redis()
            try:
                raw = await asyncio.wait_for(client.hget(key, self.settings.host), timeout)
                entry = read_blocklist_entry(raw) if raw is not None else None
                if entry is None or not entry.active(time.time()):
                    return None  # an ended entry (ttl, ``trainguard unblock``) lets it join
                return entry.reason or "no reason given"
            finally:
                await client.aclose()

        result = self.call(_get, timeout + 1.0)
        return str(result) if result else None

    # -- the link thread ------------------------------------------------------------------
    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        except Exception:
            log.exception("agent link stopped")
        finally:
            with contextlib.suppress(Exception):
                loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        s = self.settings
        while not self._stop.is_set():
            try:
                nc = await connect_nats(s.nats_url, name=f"trainguard-agent-{s.host}",
                                        timeout=s.connect_timeout,
                                        access=s.access.nats_options())
                break
            except BusUnavailable as exc:
                log.warning("%s; retrying", exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), 2.0)
        else:
            return
        self._bus = bus = Bus(nc, s.subjects, source=f"trainguard/agent/{s.host}")
        tasks: list[asyncio.Task[None]] = []
        try:
            if not await self._streams_ready(bus):
                return
            spec = consumer_spec(s)
            if s.access.own_identity:  # jwt mode: the control plane creates it
                if (stream := await self._consumer_from_control_plane(bus)) is None:
                    return
            else:
                stream = await ensure_consumer(bus.js, s.prefix, spec)  # the stream's replicas
            sub = await bus.js.pull_subscribe_bind(spec.durable, stream)
            self.hello.time = time.time()
            await bus.publish_durable(s.subjects.reg_node(s.job, s.host), self.hello)
            self.ready.set()
            tasks = [asyncio.create_task(self._commands(sub)),
                     asyncio.create_task(self._node_beats()),
                     asyncio.create_task(self._gpu_samples())]
            if self.rank_credentials is not None:
                tasks.append(asyncio.create_task(
                    self.rank_credentials.renew_forever(bus.nc, self._stop)))
            while not self._stop.is_set():
                await self._drain()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), 0.1)
            await self._drain()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await bus.close()

    async def _consumer_from_control_plane(self, bus: Bus) -> str | None:
        """Ask the control plane's issuer for this host's command consumer (``jwt`` mode:
        the agent's credential may bind it, not create it) until it is made; its stream's
        name, or None if stopped first."""
        assert self._stop is not None
        s = self.settings
        subject = s.subjects.rpc_consumer(s.job, s.host)
        body = CONSUMER.encode_request(CommandConsumerRequest(host=s.host))
        logged = False
        while not self._stop.is_set():
            try:
                msg = await bus.nc.request(subject, body, timeout=s.connect_timeout)
                reply = CONSUMER.decode_reply(msg.data)
                if reply.ok:
                    return reply.stream
                why = reply.reason
            except Exception as exc:
                why = repr(exc)
            if not logged:
                log.warning("waiting for the control plane's issuer to create this host's "
                            "command consumer (is `trainguard up --auth jwt` running?): %s",
                            why)
                logged = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), 2.0)
        return None

    async def _streams_ready(self, bus: Bus) -> bool:
        """The streams exist: provisioned here where this agent may (a server without auth),
        else by the services (with auth only they may), which an agent that starts first
        waits for while its ranks train."""
        assert self._stop is not None
        specs = streams(self.settings.prefix, replicas=self.settings.stream_replicas)
        if not self.settings.access.credentials:
            with contextlib.suppress(Exception):
                await provision(bus.js, specs)
        logged = False
        while not self._stop.is_set():
            try:
                missing = await missing_streams(bus.js, specs)
            except Exception as exc:
                missing = [repr(exc)]
            if not missing:
                return True
            if not logged:
                log.warning("waiting for the control plane to provision %s",
                            ", ".join(missing))
                logged = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), 1.0)
        return False

    def deregister(self, timeout: float = 3.0) -> None:
        """Announce that this launcher left the job: the same ``NodeHello`` with ``left``
        set, published durably (the remediator drops the host's node record on it, and a
        blip only delays it: JetStream redelivers). Bounded: a bus outage only delays the
        end by ``timeout``, and the record then stays until the job's incidents time out."""
        left = msgspec.structs.replace(self.hello, left=True, time=time.time())
        s = self.settings

        async def _publish() -> bool:
            bus = self._bus
            if bus is None:  # never connected: nothing recorded this host either
                return True
            await asyncio.wait_for(
                bus.publish_durable(s.subjects.reg_node(s.job, s.host), left), timeout)
            return True

        if self.call(_publish, timeout + 1.0) is None:
            log.warning("could not announce that host %s left job %s", s.host, s.job)

    async def _drain(self) -> None:
        assert self._bus is not None
        while True:
            try:
                subject, msg = self._outbox.get_nowait()
            except queue.Empty:
                return
            try:  # one message id for all tries: the stream keeps one copy
                await self._bus.publish_durable(subject, msg, retry_for=OUTBOX_RETRY_S)
            except Exception as exc:
                log.warning("publish to %s failed for %g s, dropped: %r", subject,
                            OUTBOX_RETRY_S, exc)

    async def _telemetry(self, subject: str, msg: TelemetryMessage) -> None:
        assert self._bus is not None
        with contextlib.suppress(nats.errors.Error, OSError):
            await self._bus.publish_telemetry(subject, msg)

    async def _node_beats(self) -> None:
        """A node heartbeat every ``node_interval``, and one at once when a rank's process
        state changes notably (:func:`procs.notable_change`): a frozen rank is a hang the
        detector names from this beat, so its cadence is the detection's."""
        s = self.settings
        sent: dict[int, ProcessState] | None = None
        due = 0.0
        while True:
            try:
                states, pids = self.node.states()
                now = time.monotonic()
                if sent is None or now >= due or procs.notable_change(sent, states):
                    await self._node_beat(states, pids)
                    sent, due = states, now + s.node_interval
            except Exception:
                log.debug("node heartbeat failed", exc_info=True)
            await asyncio.sleep(min(s.state_interval, s.node_interval))

    async def _node_beat(self, states: dict[int, ProcessState], pids: dict[int, int]) -> None:
        s = self.settings
        self._hb_seq += 1
        await self._telemetry(s.subjects.node(s.job, s.host), NodeHeartbeat(
            job=s.job, time=time.time(), seq=self._hb_seq, host=s.host, ranks=states,
            pids=pids, attempt=self.node.restart_count,
            restarting=self.node.restarting_since is not None,
            restarting_since=self.node.restarting_since, generation=self.node.generation,
            spares=self.node.spare_pids()))

    async def _gpu_samples(self) -> None:
        """The node's GPUs and the host probe's reading, on one subject, every
        ``gpu_interval`` (a node without GPUs still tells the diagnoser about its links,
        CPUs and kernel log), and at once when a look every ``gpu_look_interval`` finds a
        fault (:func:`gpu.alarm`). Each look drains the XIDs: they go out with it."""
        s = self.settings
        sent: list[GpuStats] | None = None
        sent_at = -math.inf
        while True:
            try:
                reading = await asyncio.to_thread(self.node.gpu_reading)
                gpus, xids = reading if reading is not None else ([], [])
                why = alarm(sent, gpus, xids)
                if why or time.monotonic() - sent_at >= s.gpu_interval:
                    if why:
                        log.info("GPU fault on %s: %s: sample sent now", s.host, why)
                    await self._gpu_sample(gpus, xids)
                    sent, sent_at = gpus, time.monotonic()
            except Exception:
                log.debug("GPU sample failed", exc_info=True)
            await asyncio.sleep(min(s.gpu_look_interval, s.gpu_interval))

    async def _gpu_sample(self, gpus: list[GpuStats], xids: list[XidEvent]) -> None:
        s = self.settings
        facts: HostFacts = await asyncio.to_thread(self.node.host_facts, gpus)
        self._gpu_seq += 1
        source = self.node.gpu.name if self.node.gpu else "none"
        await self._telemetry(s.subjects.gpu(s.job, s.host), GpuSample(
            job=s.job, time=time.time(), seq=self._gpu_seq, host=s.host, gpus=gpus, xids=xids,
            source=source, facts=facts))

    async def _commands(self, sub: Any) -> None:
        """Fetch and run commands, each isolated: whatever one raises is counted
        (:attr:`command_errors`), the command redelivered if the trouble may pass, else
        dead-lettered and terminated, and the loop goes on to the next."""
        while True:
            try:
                msgs = await sub.fetch(8, timeout=1.0)
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            except Exception as exc:
                log.debug("command fetch failed: %r", exc)
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                try:
                    await self._command(msg)
                except TRANSIENT_ERRORS as exc:  # NATS away mid-command: it comes back
                    self.command_errors["transient"] += 1
                    if delivery_facts(msg)[1] >= self.settings.max_deliver:
                        await self._refuse(msg, f"interrupted on every delivery, last: {exc!r}")
                        continue
                    log.warning("command on %s interrupted (%r); redelivering", msg.subject,
                                exc)
                    with contextlib.suppress(Exception):
                        await msg.nak(delay=2.0)
                except Exception as exc:
                    self.command_errors["handler_error"] += 1
                    log.exception("command on %s failed", msg.subject)
                    await self._refuse(msg, f"the agent failed on it: {exc!r}")

    async def _command(self, msg: Any) -> None:
        headers = normalize_headers(msg.headers)
        try:
            cmd = decode_as(msg.data, headers.get(H_TYPE), Command)
        except DecodeError as exc:
            self.command_errors[decode_reason(exc)] += 1
            await self._refuse(msg, exc.reason)
            return
        ctx = tracing.extract(headers)
        with tracing.tracer("trainguard.agent").start_as_current_span(
            f"process {msg.subject}", context=ctx,
            attributes={"trainguard.job": cmd.job, "trainguard.host": self.settings.host,
                        "trainguard.command": cmd.kind},
        ):
            await msg.in_progress()
            ceiling = await self._epoch_ceiling(cmd) \
                if self.executor.receiver.raises_epoch(cmd) else None
            ack = await asyncio.to_thread(self.executor.handle, cmd, ceiling)
            if ack is not None:
                await self._ack(cmd, ack)
        with contextlib.suppress(Exception):
            await msg.ack()

    async def _refuse(self, msg: Any, reason: str) -> None:
        """Dead-letter a command (bounded: :mod:`trainguard.runtime.deadletter`), then ``term`` it;
        never raises (a letter that cannot be sent is logged and counted)."""
        assert self._bus is not None
        headers, deliveries = delivery_facts(msg)
        try:
            await self._bus.dead_letter(subject=msg.subject, payload=msg.data, reason=reason,
                                        service="agent",
                                        consumer=consumer_spec(self.settings).durable,
                                        headers=headers, deliveries=deliveries)
        except Exception as exc:
            self.command_errors["dead_letter_failed"] += 1
            log.error("dead-lettering the command on %s failed (%r); terminating it: %s",
                      msg.subject, exc, clip(reason, MAX_REASON))
        with contextlib.suppress(Exception):
            await msg.term()

    async def _epoch_ceiling(self, cmd: Command) -> int | Unreadable | None:
        """The issuers' current fencing epoch, which only the remediator's leader raises (the
        coordinator sends with it too), read from the fence bucket only the remediator's
        role may write (:mod:`trainguard.runtime.fencing`): never from Redis, whose every
        service user could raise a copy. :class:`Unreadable` when the bucket does not
        answer: the raise is refused (the fence fails closed), commands at the epoch
        already admitted still run."""
        if cmd.issuer not in ("remediator", "coordinator"):
            return None
        assert self._bus is not None
        try:
            return await asyncio.wait_for(
                Epochs(self._bus.js, self.settings.prefix).current("remediator",
                                                                   create=False), 2.0)
        except Exception as exc:
            log.warning("cannot read the remediator's epoch from the fence bucket (%r): "
                        "refusing epoch %d of %s until it can be read", exc, cmd.epoch,
                        cmd.issuer)
            return Unreadable(f"the fence bucket: {type(exc).__name__}")

    async def _ack(self, cmd: Command, ack: CommandAck) -> None:
        assert self._bus is not None
        try:
            subject = self.settings.subjects.ack(cmd.job, cmd.issuer)
        except InvalidToken:
            return
        try:  # one message id for all tries: the issuer sees one ack, not one per try
            await self._bus.publish_durable(subject, ack, retry_for=self.settings.publish_retry_s)
        except Exception as exc:
            log.warning("the ack of command %s could not be published: %r", cmd.id, exc)
