"""``trainguard.Guard``: what a training loop touches.

Five lines to adopt, near-zero cost per step, and never the reason a job slows down or
dies: the training thread only times steps and phases and appends to bounded deques; a
background thread (:mod:`.transport`) does every network operation; commands run at safe
points (:mod:`.commands`). No exception from the client's machinery reaches the training
loop, except the ``crash`` drill, which exists to do exactly that.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from trainguard.contract import envnames
from trainguard.contract.codec import decode_durable
from trainguard.contract.errors import DecodeError, TrainguardError
from trainguard.contract.rpc import RESUME, ResumeRequest, decode_resume
from trainguard.contract.schemas import (
    RANK_DRILLS,
    CheckpointReport,
    Command,
    RankHello,
    RecoveryReport,
    ResumePoint,
    SnapshotReport,
)
from trainguard.contract.subjects import DEFAULT_PREFIX, Subjects
from trainguard.core.auth import TlsFiles, access_from
from trainguard.core.identity import Identity, environment_record, resolve_identity
from trainguard.core.rankstate import QUIET_BEAT_S, STALL_CHECK_S, RankState
from trainguard.recovery.handle import RESUME_TIMEOUT, Handler
from trainguard.recovery.loop import CommandState, Loop, Recovery, iterate

from . import fastexit, frdump
from .activity import Activity
from .commands import CommandDesk
from .drills import Drills
from .reports import GRAD_SPIKE_FACTOR, Reports
from .steps import Step
from .throttle import Latest
from .transport import Transport
from .values import optimizer_lr

log = logging.getLogger("trainguard.client")

SNAPSHOT_REPORT_INTERVAL = 1.0
"""Seconds at least between a rank's memory snapshot reports (the newest goes out)."""

PhaseAccounting = Callable[[dict[str, float]], None]
"""Adjusts a finished step's phase durations (the DDP hook moves collective wait to comm)."""


class Guard:
    """The trainer's handle on trainguard: heartbeats, step reports, commands.

    Args:
        job: job name (one subject token); default ``TRAINGUARD_JOB``.
        rank, world_size, host: default to torchrun's ``RANK``/``WORLD_SIZE`` and
            ``TRAINGUARD_HOST`` or the hostname.
        nats_url: default ``TRAINGUARD_NATS_URL`` or ``nats://127.0.0.1:4222``.
        heartbeat_interval: seconds between heartbeats (background thread).
        report_every: one StepReport per this many steps (aggregated).
        fingerprint_every: steps between parameter fingerprints (0: off; needs ``attach``).
        sync_every: the most steps between collective-command agreements across ranks.
        sync_period: seconds between those agreements the ranks aim at (a rollback or a
            save-now waits for the next one); never less than a step.
        allow_drills: accept drill commands; default ``TRAINGUARD_ALLOW_DRILLS``.
        checkpoint_every: initial interval for :meth:`should_checkpoint` (the coordinator
            may change it with ``set_interval``); None: never until told.
        enabled: False (or ``TRAINGUARD_DISABLED=1``) makes every call a no-op.
        grad_spike_factor: a step's gradient norm above this many times the median of the
            recent finite ones names, in its report, the parameters with the largest
            gradients (0: never). A non-finite norm always names where it started.
        credentials: this rank's credentials file (a role's JSON, or this rank's own
            NATS ``.creds`` in ``jwt`` mode); default ``TRAINGUARD_CREDENTIALS``, which the
            agent sets.
    """

    def __init__(
        self,
        job: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        host: str | None = None,
        nats_url: str | None = None,
        *,
        heartbeat_interval: float = 1.0,
        report_every: int = 1,
        fingerprint_every: int = 50,
        sync_every: int = 10,
        sync_period: float = 0.25,
        allow_drills: bool | None = None,
        prefix: str | None = None,
        buffer_size: int = 10_000,
        close_timeout: float = 5.0,
        checkpoint_every: int | None = None,
        seed: int | None = None,
        collective_timeout: float = 30.0,
        enabled: bool | None = None,
        fast_exit: bool | None = None,
        grad_spike_factor: float = GRAD_SPIKE_FACTOR,
        credentials: str | None = None,
    ) -> None:
        env = os.environ
        self.identity: Identity = resolve_identity(job, rank, world_size, host)
        self.enabled = enabled if enabled is not None else not envnames.flag(env,
                                                                            envnames.DISABLED)
        if heartbeat_interval <= 0:
            raise ValueError(f"heartbeat_interval={heartbeat_interval}: must be positive")
        if sync_period < 0:
            raise ValueError(f"sync_period={sync_period}: must be 0 (every step) or more")
        self.job = self.identity.job
        self.rank = self.identity.rank
        self.world_size = self.identity.world_size
        self.host = self.identity.host
        self.subjects = Subjects(prefix or env.get(envnames.SUBJECT_PREFIX) or DEFAULT_PREFIX)
        self.nats_url = nats_url or env.get(envnames.NATS_URL) or "nats://127.0.0.1:4222"
        self.heartbeat_interval = heartbeat_interval
        self.close_timeout = close_timeout
        self.fast_exit = fast_exit if fast_exit is not None else \
            env.get(envnames.FAST_EXIT, "1").lower() not in envnames.FALSE
        """A crash ends the process once reported, while peers wait to recover in place
        (:mod:`.fastexit`)."""
        self.seed = seed
        self.allow_drills = allow_drills if allow_drills is not None else \
            envnames.flag(env, envnames.ALLOW_DRILLS)
        self.checkpoint_root: str | None = env.get(envnames.CHECKPOINT_ROOT)
        self.model: Any = None
        self.optimizer: Any = None

        self.state = RankState()
        self._activity = Activity()
        """What the heartbeat reports; phases, drills and the DDP hook write it."""
        self.transport = Transport(self.nats_url, name=f"trainguard-{self.job}-{self.rank}",
                                   source=f"trainguard/rank/{self.job}/{self.rank}",
                                   buffer_size=buffer_size,
                                   access=_access(env, credentials))
        """The background thread and its buffers (read-only for callers: stats, tests)."""
        self.commands = CommandDesk(self.identity, self.subjects, self.transport,
                                    sync_every=sync_every, sync_period=sync_period,
                                    collective_timeout=collective_timeout, state=self.state)
        self.commands.absorb_failures(
            lambda completed, error: self._absorb(completed, error, failed_step=completed + 1))
        """Handlers by kind, the inbox, and what ran."""
        self._step_subject = self.subjects.step(self.job, self.rank)
        self._fp_subject = self.subjects.fp(self.job, self.rank)
        self.reports = Reports(
            self.job, self.rank, self.identity.attempt.restart_count,
            report_every=report_every, fingerprint_every=fingerprint_every,
            model=lambda: self.model,
            publish_step=lambda r: self.transport.publish(self._step_subject, r),
            publish_fingerprint=lambda f: self.transport.publish(self._fp_subject, f),
            world_size=self.world_size, lr=lambda: optimizer_lr(self.optimizer),
            grad_spike_factor=grad_spike_factor)
        self._snapshots: Latest[SnapshotReport] = Latest(SNAPSHOT_REPORT_INTERVAL)
        """Memory snapshot reports: the newest, at most one a second."""
        self._drills = Drills(self.state, lambda: self.allow_drills, lambda: self.model)
        self._phase_accounting: PhaseAccounting | None = None
        self._interval = (checkpoint_every or 0, 0)
        self._started = False
        self._closed = False
        self._close_hooks: list[Callable[[], None]] = []
        self._stepped_hooks: list[Callable[[float | None], None]] = []
        self._step_done_hooks: list[Callable[[int], None]] = []
        self._lock = threading.Lock()
        self._recovery: Recovery | None = None
        self._loop: Loop | None = None
        self._fr: frdump.Trigger | None = None
        self.joining = env.get(envnames.JOIN, "") == envnames.JOIN_PEERS
        """This rank replaces a failed one: its state comes from its peers at the first
        iteration of :meth:`steps`, so ``resume_point()`` loads nothing."""
        self.on("set_interval", self._set_interval)
        for kind in RANK_DRILLS:
            self.on(kind, self._drills.handle)

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> Guard:
        """Connect in the background and say hello; implicit on first use."""
        with self._lock:
            if self._started or self._closed or not self.enabled:
                return self
            self._started = True
        t = self.transport
        self.commands.listen()
        t.every(self.heartbeat_interval, self._beat)
        t.every(STALL_CHECK_S, self._beat_if_stalled)
        t.every(SNAPSHOT_REPORT_INTERVAL, self._snapshot_due)
        self._fr = frdump.Trigger.from_env(self.rank)
        if self._fr is not None:
            t.every(frdump.POLL_S, self._fr.poll)  # the agent's flight-recorder dump requests
        self._say_hello()
        t.start()
        self._install_stack_dumps()
        ref = weakref.ref(self)

        def _close_at_exit() -> None:
            guard = ref()
            if guard is not None:
                guard.close()

        atexit.register(_close_at_exit)
        return self

    def close(self, timeout: float | None = None) -> None:
        """Flush queued telemetry and acks, bounded by ``timeout``; never hangs longer."""
        if self._closed:
            return
        self._closed = True
        self._run_stepped_hooks(None)
        for hook in self._close_hooks:
            try:
                hook()
            except Exception:  # a hook must not keep the guard from closing
                log.debug("close hook failed", exc_info=True)
        try:
            if self._started:
                # Silence after this is a finished rank, not an unresponsive one.
                self.state.phase = "closed"
                self._beat()
            held = self._snapshots.flush()
            if held is not None:
                self._send_snapshot(held)
            self.reports.poll(force=False)
            self.reports.flush()
            self.transport.close(self.close_timeout if timeout is None else timeout)
        except Exception:
            log.debug("close failed", exc_info=True)

    def __enter__(self) -> Guard:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    @staticmethod
    def _install_stack_dumps() -> None:
        """SIGUSR1 dumps every thread's stack, even while blocked in a collective (the
        agent's ``dump``). No SIGTERM/SIGINT handler: a Python handler cannot run while
        the main thread is blocked in gloo, so it would only delay the process's death."""
        with contextlib.suppress(AttributeError, ValueError, RuntimeError, OSError):
            faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)

    # -- the training loop's API ------------------------------------------------------
    def step(self, n: int) -> Step:
        return Step(n, self.state, self._enter, self._exit)

    def steps(self, start: int, stop: int) -> Iterator[int]:
        """``for step in guard.steps(start, stop):`` instead of ``range(start, stop)``.

        With ``trainguard.torch.init_process_group`` a step abandoned because a peer was
        lost is recovered in place here (the group re-forms, state comes from a peer) and
        run again; a rollback in place continues after the checkpoint's step. Without it,
        the same steps as ``range``."""
        self.start()
        loop = self._loop = Loop()
        try:
            yield from iterate(loop, start, stop, self._recovery, self._regrouped,
                               self._step_done)
        finally:
            self._loop = None
            self.joining = False

    def set_recovery(self, recovery: Recovery | None) -> None:
        """Installed by ``trainguard.torch.init_process_group``."""
        self._recovery = recovery
        if recovery is not None:
            self.commands.watch_generation(recovery.watched_generation,
                                           self._generation_agreed)
            # The agreement's side group goes with the old group: held past the teardown,
            # its sockets stay open, and a peer blocked on this rank in an agreement (it
            # lost no peer of its own there) waits out the 60 s collective timeout.
            recovery.on_teardown(self.commands.regrouped)
            if self.fast_exit and recovery.enabled:  # only where peers wait for its exit
                fastexit.install(lambda: self.close(min(self.close_timeout,
                                                        fastexit.FLUSH_S)))

    def _generation_agreed(self, generation: int) -> None:
        """The ranks agreed that the job's group is at ``generation``: above this rank's,
        the loop re-forms after the current step (a host was taken back in place)."""
        if self._recovery is not None and self._loop is not None \
                and generation > self._recovery.generation:
            self._loop.regroup = True

    @property
    def recovery(self) -> Recovery | None:
        return self._recovery

    @property
    def abandoned(self) -> int | None:
        """The step a lost peer kept from completing, until the loop recovers (None
        otherwise): code after ``with guard.step(n)`` skips its per-step work when it is
        ``n`` (the step runs again). A peer lost after ``n`` completed (in the command
        agreement at its end) abandons no step: ``n``'s work runs as on every other rank,
        and the group resumes after it."""
        loop = self._loop
        if loop is None or loop.abandoned is None or loop.failed_step != loop.abandoned:
            return None
        return loop.abandoned

    @property
    def regrouping(self) -> bool:
        """A lost peer was absorbed and the loop re-forms the group at its next iteration:
        until then the group runs no collective (a save would meet a dead peer)."""
        return self._loop is not None and self._loop.abandoned is not None

    @property
    def nonfinite_at(self) -> int | None:
        """The first step this rank reported a non-finite loss or gradient norm since its
        state was last restored (:meth:`rewind`); None when there was none."""
        return self.reports.nonfinite_at

    def rewind(self, next_step: int) -> None:
        """Continue the ``guard.steps`` loop at ``next_step`` (a rollback in place has just
        restored the state after ``next_step - 1``). Raises when the trainer does not
        iterate ``guard.steps``: its loop could not go back."""
        if self._loop is None:
            raise RuntimeError("the trainer does not iterate guard.steps(): it cannot go "
                               "back to a checkpoint in place")
        self._loop.next_step = next_step
        self.reports.nonfinite_at = None  # the state is restored from before it
        self.commands.note_completed(next_step - 1, timed=False)

    def await_commands(self, timeout: float) -> bool:
        """Wait, at most ``timeout`` seconds, until this rank receives commands (connected
        and subscribed); False if it does not by then. A replacement waits before it joins
        the state agreement: a command sent after it would otherwise reach its peers only."""
        self.start()
        if not self.enabled:
            return False
        return self.transport.wait_connected(time.monotonic() + timeout)

    @property
    def command_state(self) -> CommandState:
        """What the collective commands agreed so far made of this Guard (a replacement
        adopts its peers')."""
        every, from_step = self._interval
        return CommandState(command_seq=self.commands.agreed_seq, checkpoint_every=every,
                            checkpoint_from=from_step, scheduled=tuple(self.commands.scheduled))

    def adopt_command_state(self, state: CommandState) -> None:
        self.commands.adopt_agreed(state.command_seq)
        self.commands.adopt_scheduled(list(state.scheduled))
        self._interval = (state.checkpoint_every, state.checkpoint_from)

    def publish_recovery(self, report: RecoveryReport) -> None:
        """Used by ``trainguard.torch``'s in-place recovery (durable, retried until acked)."""
        self.start()
        if self.enabled:
            self.transport.publish_durable(self.subjects.recovery(self.job, self.rank), report)

    def on(self, kind: str, handler: Handler) -> None:
        """Run ``handler(command)`` for commands of ``kind`` at safe points; its return
        value (a string) goes into the ack's detail, an exception makes the ack failed."""
        self.commands.handlers[kind] = handler

    def attach(self, model: Any, optimizer: Any = None) -> None:
        """Give the Guard the model (fingerprints, drills) and optimizer (checkpoints)."""
        self.model = model
        self.optimizer = optimizer

    def should_checkpoint(self, step: int) -> bool:
        """True after every ``every_steps``-th step since ``from_step``: integer arithmetic,
        identical on every rank once they run the same ``set_interval``."""
        every, from_step = self._interval
        if self.regrouping:
            return False
        return every > 0 and step >= from_step and (step - from_step + 1) % every == 0

    @property
    def last_completed_step(self) -> int | None:
        """The last step this rank finished (None before the first)."""
        return self.commands.last_completed

    @property
    def fingerprint_every(self) -> int:
        """Steps between parameter fingerprints (0: none): memory snapshots keep the state
        of each fingerprinted step, where a mismatch found at the next goes back to."""
        return self.reports.fingerprint_every

    @property
    def started(self) -> bool:
        """Whether :meth:`start` ran (a disabled Guard never starts)."""
        return self._started

    @property
    def connected(self) -> bool:
        """Connected to NATS right now."""
        return self.transport.connected

    def set_phase_accounting(self, fn: PhaseAccounting | None) -> None:
        """Let ``fn`` adjust each finished step's phase durations before they are reported
        (``trainguard.torch.instrument_ddp`` moves the collective wait into ``comm``)."""
        self._phase_accounting = fn

    def after_step(self, fn: Callable[[float | None], None]) -> None:
        """Run ``fn(now)`` once, when the next step of this process ends (a report that
        says how long the way back to training took); ``fn(None)`` at :meth:`close` if no
        step ended by then."""
        self._stepped_hooks.append(fn)

    def drill_target(self, kind: str, fn: Callable[[dict[str, Any]], str]) -> None:
        """``fn(params)`` plays drill ``kind`` on what a helper holds (allowed only where
        drills are); it returns what it did."""
        self._drills.targets[kind] = fn

    def each_step(self, fn: Callable[[int], None]) -> None:
        """Run ``fn(step)`` after every step the ``guard.steps`` loop completed and goes on
        from (a memory snapshot's moment: the optimizer stepped, nothing rewound)."""
        self._step_done_hooks.append(fn)

    def _step_done(self, step: int) -> None:
        for hook in self._step_done_hooks:
            try:
                hook(step)
            except Exception:  # a snapshot must not fail the step
                log.warning("per-step hook failed", exc_info=True)

    def _run_stepped_hooks(self, now: float | None) -> None:
        hooks, self._stepped_hooks = self._stepped_hooks, []
        for hook in hooks:
            try:
                hook(now)
            except Exception:  # a report must not fail the step
                log.debug("after-step hook failed", exc_info=True)

    def on_close(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` first thing in :meth:`close` (a Checkpointer finishes its save)."""
        self._close_hooks.append(fn)

    @property
    def checkpoint_interval(self) -> tuple[int, int]:
        """``(every_steps, from_step)``; every_steps 0 means no periodic checkpoints."""
        return self._interval

    def resume_point(self, root: str | None = None, timeout: float = RESUME_TIMEOUT, *,
                     below_step: int | None = None) -> ResumePoint | None:
        """The newest committed checkpoint: asks the coordinator, else reads
        ``<root>/<job>/LATEST``. None only when neither has one, so a restart while the
        bus is down never silently starts from step 0. Asking costs at most ``timeout``
        (connecting included), and nothing once a connect attempt has failed.

        ``below_step``: the newest committed one below that step instead (a rank that
        could not load the newest falls back); only the coordinator knows those.

        None for a replacement joining in place (:attr:`joining`): its state comes from
        its peers, and a checkpoint load would wait for peers that never call it."""
        if self.joining:
            return None
        self.start()
        if self.enabled:
            reply = self._transport_request(timeout, below_step)
            if reply:
                try:
                    return decode_resume(reply)
                except DecodeError as exc:
                    log.warning("bad resume-point reply: %s", exc.reason)
        if below_step is not None:
            return None
        root = root or self.checkpoint_root
        if root:
            latest = Path(root) / self.job / "LATEST"
            try:
                return decode_durable(latest.read_bytes(), ResumePoint)
            except FileNotFoundError:
                return None
            except (OSError, DecodeError) as exc:
                log.warning("unreadable %s: %s", latest, exc)
        return None

    def _transport_request(self, timeout: float, below_step: int | None = None) -> bytes | None:
        deadline = time.monotonic() + timeout
        # Right after start the connection may still be coming up: wait for it, bounded,
        # and not at all once an attempt failed (a refused connect is a bus that is down).
        if not self.transport.wait_connected(deadline, until_failure=True):
            return None
        remaining = max(0.05, deadline - time.monotonic())
        payload = RESUME.encode_request(ResumeRequest(rank=self.rank,
                                                      requester=self.identity.responder,
                                                      below_step=below_step))
        return self.transport.request(RESUME.subject(self.subjects, self.job), payload,
                                       remaining)

    def publish_checkpoint_report(self, report: CheckpointReport) -> None:
        """Used by ``trainguard.torch.Checkpointer`` (durable, retried until acked)."""
        self.start()
        if self.enabled:
            self.transport.publish_durable(self.subjects.ckpt(self.job, self.rank), report)

    def publish_snapshot(self, report: SnapshotReport) -> None:
        """Used by ``trainguard.torch``'s memory snapshots, from their check thread, once a
        snapshot is verified: telemetry, at most one a second; a newer one replaces the
        one held meanwhile, which the transport thread sends when the second is over.
        Never blocks (a deque append)."""
        if not self.enabled:
            return
        out = self._snapshots.offer(report, time.monotonic())
        if out is not None:
            self._send_snapshot(out)

    def _snapshot_due(self) -> None:
        out = self._snapshots.due(time.monotonic())
        if out is not None:
            self._send_snapshot(out)

    def _send_snapshot(self, report: SnapshotReport) -> None:
        # The report's own rank: one built before a resize goes out on its subject.
        self.transport.publish(self.subjects.snap(self.job, report.rank), report)

    def stats(self) -> dict[str, Any]:
        s = self.transport.stats
        return {"sent": s.sent, "dropped": s.dropped, "durable_sent": s.durable_sent,
                "durable_dropped": s.durable_dropped, "connects": s.connects,
                "queued": len(self.transport.telemetry),
                "commands_run": len(self.commands.executed),
                "connected": self.transport.connected}

    # -- safe points ------------------------------------------------------------------
    def _enter(self, step: Step) -> None:
        if not self._started:
            self.start()
        self.state.begin_step(step.n)
        if self.commands.has_work:
            self.commands.safe_point(None)
        drills = self._drills.on_entry
        while drills:
            log.warning("drill: %s", drills.pop(0)())

    def _exit(self, step: Step, duration: float, *, failed: bool,
              error: BaseException | None = None) -> bool:
        self.state.end_step(None if failed else duration)
        if failed:
            return self._absorb(step.n, error)
        if self._stepped_hooks:
            self._run_stepped_hooks(time.time())
        if not self.enabled:  # still tracked: a Checkpointer warms up after the first step
            self.commands.note_completed(step.n)
            return False
        try:
            if self._phase_accounting is not None:
                self._phase_accounting(step.phases)
            if self.reports.record(step, duration, nan_loss=self._drills.nan_pending):
                self._drills.nan_pending = False
        except Exception:
            log.debug("step report failed", exc_info=True)
        self.commands.note_completed(step.n)
        self.commands.safe_point(step.n)  # DrillCrash propagates on purpose
        return False

    def _absorb(self, n: int, error: BaseException | None, *,
                failed_step: int | None = None) -> bool:
        """Abandon step ``n`` for an in-place recovery, if the failure is a lost peer and
        the loop is ``guard.steps`` (a ``range`` loop could not run the step again).
        ``failed_step``: the step the failure kept from completing, when not ``n`` itself
        (a failure after ``n`` completed: the code after the step still skips its work)."""
        loop, recovery = self._loop, self._recovery
        if loop is None or recovery is None or not isinstance(error, Exception):
            return False
        try:
            absorbed = recovery.absorbs(error)
        except Exception:
            log.debug("recovery.absorbs failed", exc_info=True)
            return False
        if absorbed:
            # The finished frames' locals (the failed collective's work, its tensors) would
            # keep the old process group and its sockets alive until the loop moves on.
            traceback.clear_frames(error.__traceback__)
            loop.abandoned, loop.error = n, error
            loop.failed_step = n if failed_step is None else failed_step
        return absorbed

    def _regrouped(self, next_step: int) -> None:
        """After a re-form: the group continues after step ``next_step - 1`` (the source's
        state), and the command agreement's side group went with the old group: the first
        step the group completes builds it again on every rank, and agrees there."""
        self.commands.note_completed(next_step - 1, timed=False)
        self.commands.regrouped()

    def _say_hello(self) -> None:
        """The rank's hello: who it is, at which attempt and world size, in which
        environment (sent again when the group goes on at another size)."""
        hello = RankHello(job=self.job, rank=self.rank, world_size=self.world_size,
                          local_rank=self.identity.local_rank, host=self.host,
                          pid=os.getpid(), attempt=self.identity.attempt,
                          env={**environment_record(self.seed),
                               **envnames.job_settings(os.environ),
                               "drills": "1" if self.allow_drills else "0"},
                          time=time.time())
        self.transport.publish_durable(self.subjects.reg_rank(self.job, self.rank), hello)

    def resize(self, world_size: int, rank: int | None = None) -> None:
        """The group re-formed in place at ``world_size`` (a host left), this rank now
        ``rank`` (default: unchanged): its reports, acks, command subjects and agreement
        follow, and a new hello tells the control plane."""
        rank = self.rank if rank is None else rank
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a group of {world_size}")
        renumbered = rank != self.rank
        self.rank, self.world_size = rank, world_size
        self.identity = dataclasses.replace(self.identity, rank=rank, world_size=world_size)
        self.reports.rank, self.reports.world_size = rank, world_size
        self._step_subject = self.subjects.step(self.job, rank)
        self._fp_subject = self.subjects.fp(self.job, rank)
        self.commands.renumber(self.identity, subscribe=renumbered and self._started)
        if renumbered and self._fr is not None:
            self._fr.renumber(rank)
        if self._started and not self._closed:
            self._say_hello()

    # -- background thread ------------------------------------------------------------
    def _beat(self) -> None:
        identity = self.identity  # one read: a resize on the training thread may be midway
        said = self._activity.said(self.state.looked_at(time.monotonic()))
        hb = self.state.heartbeat(identity, self.transport.stats.dropped, said)
        self.transport.publish(self.subjects.hb(self.job, identity.rank), hb)

    def _beat_if_stalled(self) -> None:
        """Beats early when a step runs long, and when a phase has shown no work for
        ``QUIET_BEAT_S`` (once per phase): a stuck loader is told the moment it is one."""
        now = time.monotonic()
        activity = self._activity
        quiet = activity.look(self.state.looked_at(now), now)
        if self.state.stalled(now):
            self._beat()
        elif quiet >= QUIET_BEAT_S and not activity.beat_sent:
            activity.beat_sent = True
            self._beat()

    # -- built-in command handlers ----------------------------------------------------
    def _set_interval(self, cmd: Command) -> str:
        every = int(cmd.params.get("every_steps", 0))
        if every < 0:
            raise ValueError(f"every_steps={every} must be >= 0")
        from_step = int(cmd.params.get("from_step", (self.state.step or 0) + 1))
        self._interval = (every, from_step)
        return f"checkpoint every {every} steps from step {from_step}"


def _access(env: Mapping[str, str], credentials: str | None = None) -> dict[str, Any]:
    """The rank's credentials (``credentials``, else the agent's variable) and CA. A bad
    file costs the job its telemetry (logged), never its training."""
    try:
        return access_from(credentials if credentials is not None
                           else env.get(envnames.CREDENTIALS, ""),
                           nats_tls=TlsFiles(ca=env.get(envnames.NATS_TLS_CA, ""))
                           ).nats_options()
    except (TrainguardError, OSError) as exc:
        log.error("trainguard: cannot use the rank credentials (%s); connecting without", exc)
        return {}
