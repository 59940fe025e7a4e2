"""What a rank is doing right now: the one object the heartbeat reads.

Phases and steps (:mod:`.steps`), drills (:mod:`.drills`) and the DDP hook
(``trainguard.torch.ddp``) write it on the training thread or in autograd's callbacks; the
heartbeat reads it on the transport thread. Plain attributes: each read and write is atomic
under the GIL, and a heartbeat that mixes two moments of one step is harmless.
"""

from __future__ import annotations

import os
import time

from trainguard.contract.schemas import Heartbeat

from .identity import Identity


class RankState:
    """The current step and phase, collective counters and the ``slow`` drill's factor."""

    __slots__ = ("coll_done", "coll_seq", "comm_outstanding", "hb_seq", "phase", "phase_t0",
                 "slow_factor", "step")

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

    def enter(self, phase: str) -> None:
        """``phase`` begins now."""
        self.phase = phase
        self.phase_t0 = time.monotonic()

    def heartbeat(self, identity: Identity, dropped: int) -> Heartbeat:
        """The next heartbeat (``dropped``: telemetry lost so far, for the detector)."""
        self.hb_seq += 1
        return Heartbeat(job=identity.job, time=time.time(), seq=self.hb_seq,
                         rank=identity.rank, attempt=identity.attempt.restart_count,
                         host=identity.host, pid=os.getpid(), step=self.step,
                         phase="comm" if self.comm_outstanding > 0 else self.phase,
                         phase_elapsed=time.monotonic() - self.phase_t0,
                         coll_seq=self.coll_seq, coll_done=self.coll_done, dropped=dropped)
