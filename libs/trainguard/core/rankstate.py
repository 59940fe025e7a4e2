"""What a rank is doing right now: the one object the heartbeat reads.

Phases and steps (:mod:`.steps`), drills (:mod:`.drills`) and the DDP hook
(``trainguard.torch.ddp``) write it on the training thread or in autograd's callbacks; the
heartbeat reads it on the transport thread. Plain attributes: each read and write is atomic
under the GIL, and a heartbeat that mixes two moments of one step is harmless.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

from trainguard.contract.schemas import Heartbeat

from .identity import Identity

STALL_BEAT_MIN_S = 0.25
STALL_BEAT_FACTOR = 4.0
"""A step this many times the usual (and at least ``STALL_BEAT_MIN_S``) sends an early
heartbeat (:meth:`RankState.stalled`)."""
STALL_CHECK_S = 0.1
"""How often the transport thread asks :meth:`RankState.stalled`."""
QUIET_LOOK_AFTER_S = 0.1
"""A phase younger than this, or than the rank's usual step, is not looked at for work
(:func:`looks_after`); from its first look on it counts as quiet while it shows none."""
QUIET_BEAT_S = 1.0
"""A phase quiet this long sends a heartbeat at once (the detector's ``quiet_floor``)."""


def looks_after(usual: float | None) -> float:
    """How old a phase is when its work is first looked at: older than a whole usual step
    is rare, so a job with long steps pays for looks only where a phase runs long."""
    return max(QUIET_LOOK_AFTER_S, usual or 0.0)


def usual_after(usual: float | None, seconds: float) -> float:
    """The moving average of step durations after one of ``seconds`` (one slow step moves
    it a tenth of the way)."""
    return seconds if usual is None else usual + 0.1 * (seconds - usual)


class RankState:
    """The current step and phase, collective counters and the ``slow`` drill's factor."""

    __slots__ = ("coll_done", "coll_seq", "comm_outstanding", "early_beat_for", "hb_seq",
                 "phase", "phase_t0", "slow_factor", "step", "step_t0", "usual_step")

    def __init__(self) -> None:
        self.step: int | None = None
        self.phase: str | None = None
        """``step`` inside a step but outside a named phase, None between steps."""
        self.phase_t0 = time.monotonic()
        self.slow_factor = 1.0
        """The ``slow`` drill: the compute phase takes this many times as long."""
        self.coll_seq = 0
        """Collectives issued (the DDP hook); the rank with the fewest is the one a hung
        job waits for."""
        self.coll_done = 0
        self.comm_outstanding = 0
        """Collectives issued and not completed: while above 0 the heartbeat says ``comm``."""
        self.hb_seq = 0
        self.step_t0: float | None = None
        """When the current step began (monotonic); None between steps."""
        self.usual_step: float | None = None
        """A moving average of this rank's step durations: what a stall is measured by."""
        self.early_beat_for: float | None = None
        """The ``step_t0`` of the step an early heartbeat was already sent for."""

    def begin_step(self, n: int) -> None:
        self.step = n
        self.enter("step")
        self.step_t0 = self.phase_t0

    def end_step(self, seconds: float | None) -> None:
        """The step ended (``seconds``: its duration when it completed, None when failed)."""
        self.phase = None
        self.step_t0 = None
        if seconds is not None:
            self.usual_step = usual_after(self.usual_step, seconds)

    def stalled(self, now: float) -> bool:
        """True once per step, when it has run well past this rank's usual step.

        A heartbeat sent then shows the detector where every rank is inside the stall a
        whole heartbeat interval sooner: a job with short steps is judged in about a
        second, and the picture it is judged on is never from before the stall."""
        t0, usual = self.step_t0, self.usual_step
        if t0 is None or usual is None or t0 == self.early_beat_for:
            return False
        if now - t0 < max(STALL_BEAT_MIN_S, STALL_BEAT_FACTOR * usual):
            return False
        self.early_beat_for = t0
        return True

    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        """A collective of trainguard's own between steps (the command agreement): counted
        like the trainer's, and the heartbeat says ``comm`` meanwhile, so a rank held
        there reads as waiting for a peer, not as idle."""
        self.coll_seq += 1
        self.comm_outstanding += 1
        try:
            yield
        finally:
            self.comm_outstanding -= 1
            self.coll_done += 1

    def looked_at(self, now: float) -> float | None:
        """The start of the phase whose work :class:`~trainguard.client.activity.Activity`
        watches: one that has run past :func:`looks_after`; None outside one (young,
        between steps, or waiting in a collective)."""
        if self.phase is None or self.comm_outstanding > 0 \
                or now - self.phase_t0 < looks_after(self.usual_step):
            return None
        return self.phase_t0

    def enter(self, phase: str) -> None:
        """``phase`` begins now."""
        self.phase = phase
        self.phase_t0 = time.monotonic()

    def heartbeat(self, identity: Identity, dropped: int, quiet_for: float = 0.0) -> Heartbeat:
        """The next heartbeat (``dropped``: telemetry lost so far, for the detector;
        ``quiet_for``: how long the phase has shown no work)."""
        self.hb_seq += 1
        return Heartbeat(job=identity.job, time=time.time(), seq=self.hb_seq,
                         rank=identity.rank, attempt=identity.attempt.restart_count,
                         host=identity.host, pid=os.getpid(), step=self.step,
                         phase="comm" if self.comm_outstanding > 0 else self.phase,
                         phase_elapsed=time.monotonic() - self.phase_t0,
                         coll_seq=self.coll_seq, coll_done=self.coll_done, dropped=dropped,
                         quiet_for=round(quiet_for, 3))
