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
import faulthandler
import logging
import math
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from ..codec import decode_durable
from ..errors import DecodeError
from ..rpc import RESUME, ResumeRequest, decode_resume
from ..schemas import (
    RANK_DRILLS,
    CheckpointReport,
    Command,
    Fingerprint,
    Heartbeat,
    RankHello,
    ResumePoint,
    StepReport,
)
from ..subjects import DEFAULT_PREFIX, Subjects
from .commands import CommandDesk, Handler
from .drills import Drills
from .identity import Identity, environment_record, resolve_identity
from .transport import Transport
from .values import Deferred, is_tensor, read_number

log = logging.getLogger("trainguard.client")

_TRUE = ("1", "true", "yes", "on")
_NOT_JOB_SETTINGS = ("TRAINGUARD_NATS_URL", "TRAINGUARD_REDIS_URL", "TRAINGUARD_PREFIX",
                     "TRAINGUARD_JOB", "TRAINGUARD_HOST")


def job_settings(env: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """``TRAINGUARD_*`` settings the job carries in its hello (per-job detector thresholds
    such as ``TRAINGUARD_HANG_FLOOR``); connection details stay out."""
    return {k: v for k, v in env.items()
            if k.startswith("TRAINGUARD_") and k not in _NOT_JOB_SETTINGS}


class Phase:
    """``with s.phase("data"):`` — times one named phase and marks it as current."""

    __slots__ = ("_name", "_step", "_t0")

    def __init__(self, step: Step, name: str) -> None:
        self._step = step
        self._name = name
        self._t0 = 0.0

    def __enter__(self) -> Phase:
        g = self._step._guard
        self._t0 = time.perf_counter()
        g._phase = self._name
        g._phase_t0 = time.monotonic()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        elapsed = time.perf_counter() - self._t0
        g = self._step._guard
        if g._slow_factor > 1.0 and self._name == "compute":
            time.sleep(elapsed * (g._slow_factor - 1.0))  # the `slow` drill
            elapsed *= g._slow_factor
        phases = self._step.phases
        phases[self._name] = phases.get(self._name, 0.0) + elapsed
        g._phase = "step"
        g._phase_t0 = time.monotonic()


class Step:
    """``with guard.step(n) as s:`` — one training step."""

    __slots__ = ("_guard", "_t0", "extra", "grad_norm", "loss", "n", "phases", "samples",
                 "tokens")

    def __init__(self, guard: Guard, n: int) -> None:
        self._guard = guard
        self.n = n
        self.phases: dict[str, float] = {}
        self.loss: Any = None
        self.grad_norm: Any = None
        self.tokens: int | None = None
        self.samples: int | None = None
        self.extra: dict[str, Any] | None = None
        self._t0 = 0.0

    def phase(self, name: str) -> Phase:
        return Phase(self, name)

    def report(self, loss: Any = None, grad_norm: Any = None, tokens: int | None = None,
               samples: int | None = None, **extra: Any) -> None:
        """Attach metrics; numbers or 0-dim tensors (read later, without a host sync)."""
        if loss is not None:
            self.loss = loss
        if grad_norm is not None:
            self.grad_norm = grad_norm
        if tokens is not None:
            self.tokens = tokens
        if samples is not None:
            self.samples = samples
        if extra:
            self.extra = extra

    def __enter__(self) -> Step:
        self._guard._enter(self)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._guard._exit(self, time.perf_counter() - self._t0, failed=et is not None)


class _PendingReport:
    __slots__ = ("deferred", "message")

    def __init__(self, message: StepReport | Fingerprint, deferred: dict[str, Deferred]):
        self.message = message
        self.deferred = deferred


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
        sync_every: steps between collective-command agreements across ranks.
        allow_drills: accept drill commands; default ``TRAINGUARD_ALLOW_DRILLS``.
        checkpoint_every: initial interval for :meth:`should_checkpoint` (the coordinator
            may change it with ``set_interval``); None: never until told.
        enabled: False (or ``TRAINGUARD_DISABLED=1``) makes every call a no-op.
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
        allow_drills: bool | None = None,
        prefix: str | None = None,
        buffer_size: int = 10_000,
        close_timeout: float = 5.0,
        checkpoint_every: int | None = None,
        seed: int | None = None,
        collective_timeout: float = 30.0,
        enabled: bool | None = None,
    ) -> None:
        env = os.environ
        self.identity: Identity = resolve_identity(job, rank, world_size, host)
        self.enabled = enabled if enabled is not None else \
            env.get("TRAINGUARD_DISABLED", "").lower() not in _TRUE
        if report_every < 1:
            raise ValueError(f"report_every={report_every}: must be at least 1")
        if heartbeat_interval <= 0:
            raise ValueError(f"heartbeat_interval={heartbeat_interval}: must be positive")
        self.job = self.identity.job
        self.rank = self.identity.rank
        self.world_size = self.identity.world_size
        self.host = self.identity.host
        self.subjects = Subjects(prefix or env.get("TRAINGUARD_PREFIX") or DEFAULT_PREFIX)
        self.nats_url = nats_url or env.get("TRAINGUARD_NATS_URL") or "nats://127.0.0.1:4222"
        self.heartbeat_interval = heartbeat_interval
        self.report_every = report_every
        self.fingerprint_every = fingerprint_every
        self.close_timeout = close_timeout
        self.seed = seed
        self.allow_drills = allow_drills if allow_drills is not None else \
            env.get("TRAINGUARD_ALLOW_DRILLS", "").lower() in _TRUE
        self.checkpoint_root: str | None = env.get("TRAINGUARD_CHECKPOINT_ROOT")
        self.model: Any = None
        self.optimizer: Any = None

        self._transport = Transport(self.nats_url, name=f"trainguard-{self.job}-{self.rank}",
                                    source=f"trainguard/rank/{self.job}/{self.rank}",
                                    buffer_size=buffer_size)
        self._desk = CommandDesk(self.identity, self.subjects, self._transport,
                                 sync_every=sync_every, collective_timeout=collective_timeout)
        self._drills = Drills(self)
        # State the heartbeat thread reads (plain attributes: atomic under the GIL).
        self._step: int | None = None
        self._phase: str | None = None
        self._phase_t0 = time.monotonic()
        self._seq = 0
        self._hb_seq = 0
        self._slow_factor = 1.0
        self.coll_seq = 0
        self.coll_done = 0
        self.comm_outstanding = 0
        self._ddp: Any = None
        self._interval = (checkpoint_every or 0, 0)
        self._agreement_checked = False
        self._pending: list[_PendingReport] = []
        self._aggregate: list[StepReport] = []
        self._started = False
        self._closed = False
        self._close_hooks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._subj_step = self.subjects.step(self.job, self.rank)
        self._subj_fp = self.subjects.fp(self.job, self.rank)
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
        t = self._transport
        t.subscribe(self.subjects.cmd_all(self.job), self._desk.on_message)
        t.subscribe(self.subjects.cmd_rank(self.job, self.rank), self._desk.on_message)
        t.every(self.heartbeat_interval, self._beat)
        hello = RankHello(job=self.job, rank=self.rank, world_size=self.world_size,
                          local_rank=self.identity.local_rank, host=self.host,
                          pid=os.getpid(), attempt=self.identity.attempt,
                          env={**environment_record(self.seed),
                               **job_settings(os.environ),
                               "drills": "1" if self.allow_drills else "0"},
                          time=time.time())
        t.publish_durable(self.subjects.reg_rank(self.job, self.rank), hello)
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
        for hook in self._close_hooks:
            try:
                hook()
            except Exception:  # a hook must not keep the guard from closing
                log.debug("close hook failed", exc_info=True)
        try:
            if self._started:
                # Silence after this is a finished rank, not an unresponsive one.
                self._phase = "closed"
                self._beat()
            self._poll_pending(force=False)
            self._flush_aggregate()
            self._transport.close(self.close_timeout if timeout is None else timeout)
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
        return Step(self, n)

    def on(self, kind: str, handler: Handler) -> None:
        """Run ``handler(command)`` for commands of ``kind`` at safe points; its return
        value (a string) goes into the ack's detail, an exception makes the ack failed."""
        self._desk.handlers[kind] = handler

    def attach(self, model: Any, optimizer: Any = None) -> None:
        """Give the Guard the model (fingerprints, drills) and optimizer (checkpoints)."""
        self.model = model
        self.optimizer = optimizer

    def should_checkpoint(self, step: int) -> bool:
        """True after every ``every_steps``-th step since ``from_step``: integer arithmetic,
        identical on every rank once they run the same ``set_interval``."""
        every, from_step = self._interval
        return every > 0 and step >= from_step and (step - from_step + 1) % every == 0

    @property
    def last_completed_step(self) -> int | None:
        """The last step this rank finished (None before the first)."""
        return self._desk._last_completed

    def on_close(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` first thing in :meth:`close` (a Checkpointer finishes its save)."""
        self._close_hooks.append(fn)

    @property
    def checkpoint_interval(self) -> tuple[int, int]:
        """``(every_steps, from_step)``; every_steps 0 means no periodic checkpoints."""
        return self._interval

    def resume_point(self, root: str | None = None, timeout: float = 2.0) -> ResumePoint | None:
        """The newest committed checkpoint: asks the coordinator, else reads
        ``<root>/<job>/LATEST``. None only when neither has one, so a restart while the
        bus is down never silently starts from step 0."""
        self.start()
        if self.enabled:
            reply = self._transport_request(timeout)
            if reply:
                try:
                    return decode_resume(reply)
                except DecodeError as exc:
                    log.warning("bad resume-point reply: %s", exc.reason)
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

    def _transport_request(self, timeout: float) -> bytes | None:
        deadline = time.monotonic() + timeout
        # Right after start the connection may still be coming up: wait for it, bounded.
        while not self._transport.connected and time.monotonic() < deadline:
            time.sleep(0.01)
        remaining = max(0.1, deadline - time.monotonic())
        payload = RESUME.encode_request(ResumeRequest(rank=self.rank,
                                                      requester=self.identity.responder))
        return self._transport.request(RESUME.subject(self.subjects, self.job), payload,
                                       remaining)

    def publish_checkpoint_report(self, report: CheckpointReport) -> None:
        """Used by ``trainguard.torch.Checkpointer`` (durable, retried until acked)."""
        self.start()
        if self.enabled:
            self._transport.publish_durable(self.subjects.ckpt(self.job, self.rank), report)

    def stats(self) -> dict[str, Any]:
        s = self._transport.stats
        return {"sent": s.sent, "dropped": s.dropped, "durable_sent": s.durable_sent,
                "durable_dropped": s.durable_dropped, "connects": s.connects,
                "queued": len(self._transport.telemetry), "commands_run": len(self._desk.executed),
                "connected": self._transport.connected}

    # -- safe points ------------------------------------------------------------------
    def _enter(self, step: Step) -> None:
        if not self._started:
            self.start()
        self._step = step.n
        self._phase = "step"
        self._phase_t0 = time.monotonic()
        desk = self._desk
        if desk.inbox or desk._at_step:
            self._safe_point(None)
        drills = self._drills.on_entry
        while drills:
            log.warning("drill: %s", drills.pop(0)())

    def _exit(self, step: Step, duration: float, *, failed: bool) -> None:
        self._phase = None
        if not self.enabled or failed:
            return
        try:
            self._record(step, duration)
        except Exception:
            log.debug("step report failed", exc_info=True)
        self._desk.note_completed(step.n)
        self._safe_point(step.n)

    def _safe_point(self, completed: int | None) -> None:
        if completed is not None and not self._agreement_checked \
                and completed % self._desk.sync_every == 0:
            self._agreement_checked = True
            self._desk.agreement = self._make_agreement()
        self._desk.safe_point(completed)  # DrillCrash propagates on purpose

    def _make_agreement(self) -> Any:
        if self.world_size < 2 or "torch.distributed" not in sys.modules:
            return None
        try:
            from ..torch.collective import side_group_agreement

            return side_group_agreement()
        except Exception:
            log.debug("no collective agreement", exc_info=True)
            return None

    def _record(self, step: Step, duration: float) -> None:
        self._seq += 1
        if self._ddp is not None:
            self._ddp.account(step.phases)
        deferred: dict[str, Deferred] = {}
        loss = self._value("loss", step.loss, deferred)
        grad_norm = self._value("grad_norm", step.grad_norm, deferred)
        if self._drills.nan_pending and loss is not None:
            loss = math.nan
            self._drills.nan_pending = False
        extra: dict[str, float] = {}
        if step.extra:
            for k, v in step.extra.items():
                val = self._value(f"extra.{k}", v, deferred)
                if val is not None:
                    extra[k] = val
        report = StepReport(job=self.job, time=time.time(), seq=self._seq, rank=self.rank,
                            step=step.n, attempt=self.identity.attempt.restart_count,
                            duration=duration, phases=step.phases, loss=loss,
                            grad_norm=grad_norm, tokens=step.tokens, samples=step.samples,
                            extra=extra)
        if deferred:
            self._pending.append(_PendingReport(report, deferred))
        else:
            self._finish(report)
        if self.fingerprint_every and self.model is not None \
                and step.n % self.fingerprint_every == 0:
            self._fingerprint(step.n)
        if self._pending:
            self._poll_pending(force=False)

    @staticmethod
    def _value(name: str, raw: Any, deferred: dict[str, Deferred]) -> float | None:
        if raw is None:
            return None
        value = read_number(raw)
        if value is None or isinstance(value, float):
            return value
        deferred[name] = value
        return None

    def _finish(self, report: StepReport) -> None:
        """Non-finite evidence, then publish (or aggregate for ``report_every``)."""
        bad = sum(1 for v in (report.loss, report.grad_norm)
                  if v is not None and not math.isfinite(v))
        if bad:
            report.nonfinite = bad
            if report.grad_norm is not None and not math.isfinite(report.grad_norm) \
                    and self.model is not None:
                from ..torch.stats import nonfinite_grad_names

                report.nonfinite_params = nonfinite_grad_names(self.model)
        if self.report_every == 1:
            self._transport.publish(self._subj_step, report)
            return
        self._aggregate.append(report)
        if len(self._aggregate) >= self.report_every or bad:
            self._flush_aggregate()

    def _flush_aggregate(self) -> None:
        reports, self._aggregate = self._aggregate, []
        if not reports:
            return
        last = reports[-1]
        phases: dict[str, float] = {}
        for r in reports:
            for k, v in r.phases.items():
                phases[k] = phases.get(k, 0.0) + v / len(reports)
        norms = [r.grad_norm for r in reports if r.grad_norm is not None]
        last.duration = sum(r.duration for r in reports) / len(reports)
        last.phases = phases
        last.grad_norm = max(norms, key=lambda v: v if math.isfinite(v) else math.inf) \
            if norms else None
        last.nonfinite = sum(r.nonfinite for r in reports)
        last.tokens = sum(r.tokens or 0 for r in reports) or None
        last.samples = sum(r.samples or 0 for r in reports) or None
        last.steps = len(reports)
        self._transport.publish(self._subj_step, last)

    def _fingerprint(self, n: int) -> None:
        from ..torch.stats import fingerprint

        value = fingerprint(self.model)
        fp = Fingerprint(job=self.job, time=time.time(), seq=self._seq, rank=self.rank, step=n,
                         checksum=0, attempt=self.identity.attempt.restart_count)
        if is_tensor(value):
            if value.device.type == "cpu":
                fp.checksum = int(value.item())
                self._transport.publish(self._subj_fp, fp)
            else:
                from ..torch.values import defer_tensor

                self._pending.append(_PendingReport(fp, {"checksum": defer_tensor(value)}))
        else:
            fp.checksum = int(value)
            self._transport.publish(self._subj_fp, fp)

    def _poll_pending(self, *, force: bool) -> None:
        still: list[_PendingReport] = []
        for p in self._pending:
            if not (force or all(d.ready() for d in p.deferred.values())):
                still.append(p)
                continue
            msg = p.message
            for name, d in p.deferred.items():
                value = d.value()
                if isinstance(msg, Fingerprint):
                    msg.checksum = int(value)
                elif name.startswith("extra."):
                    msg.extra[name[6:]] = value
                else:
                    setattr(msg, name, value)
            if isinstance(msg, StepReport):
                self._finish(msg)
            else:
                self._transport.publish(self._subj_fp, msg)
        # A device far behind must not grow this without bound: drop the oldest.
        self._pending = still[-64:]

    # -- background thread ------------------------------------------------------------
    def _beat(self) -> None:
        self._hb_seq += 1
        phase = "comm" if self.comm_outstanding > 0 else self._phase
        hb = Heartbeat(job=self.job, time=time.time(), seq=self._hb_seq, rank=self.rank,
                       attempt=self.identity.attempt.restart_count, host=self.host,
                       pid=os.getpid(), step=self._step, phase=phase,
                       phase_elapsed=time.monotonic() - self._phase_t0,
                       coll_seq=self.coll_seq, coll_done=self.coll_done,
                       dropped=self._transport.stats.dropped)
        self._transport.publish(self.subjects.hb(self.job, self.rank), hb)

    # -- built-in command handlers ----------------------------------------------------
    def _set_interval(self, cmd: Command) -> str:
        every = int(cmd.params.get("every_steps", 0))
        if every < 0:
            raise ValueError(f"every_steps={every} must be >= 0")
        from_step = int(cmd.params.get("from_step", (self._step or 0) + 1))
        self._interval = (every, from_step)
        return f"checkpoint every {every} steps from step {from_step}"
