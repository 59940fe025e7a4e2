"""Synthetic telemetry of a synchronous data-parallel job, in simulated time.

Tests and the benchmark drive the pure :class:`~.engine.Detector` with this instead of a
real job: thousands of steps of thousands of ranks in seconds, with realistic noise
(log-normal compute per rank and step, a persistent per-rank speed, rare single slow
steps, periodic checkpoints on every rank) and faults injected on purpose (a slow rank,
a rank stuck in a phase, NaNs, a flipped fingerprint, silence).

Step ``s`` takes as long as its slowest rank (that is what synchronous training does):
each rank computes, then waits in ``comm`` for the rest. Messages are delivered in
sender-time order, interleaved with detector ticks at ``tick_every``.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
from collections.abc import Callable
from typing import Any

import msgspec

from trainguard.contract.evidence import BatchFault
from trainguard.contract.schemas import (
    Anomaly,
    Fingerprint,
    Heartbeat,
    StepReport,
    TelemetryMessage,
)
from trainguard.core.rankstate import (
    QUIET_BEAT_S,
    STALL_BEAT_FACTOR,
    STALL_BEAT_MIN_S,
    looks_after,
    usual_after,
)

from .engine import Detector
from .job import JobState
from .thresholds import Thresholds

Sink = Callable[[TelemetryMessage], None]
Tick = Callable[[float], None]


@dataclasses.dataclass
class SimConfig:
    job: str = "sim"
    ranks: int = 64
    ranks_per_host: int = 8
    compute: float = 0.3
    """Median compute seconds per step."""
    jitter: float = 0.05
    """Log-normal sigma of compute per rank and step."""
    rank_spread: float = 0.02
    """Log-normal sigma of each rank's persistent speed."""
    data: float = 0.01
    comm: float = 0.02
    hb_interval: float = 1.0
    slow_step_prob: float = 0.0005
    """Chance that a rank's step takes 2-3x (a GC pause, a bad batch): never an alert."""
    checkpoint_every: int = 0
    checkpoint_seconds: tuple[float, float] = (8.0, 12.0)
    eval_every: int = 0
    """Every this many steps every rank evaluates (phase ``eval``) before the step."""
    eval_seconds: tuple[float, float] = (5.0, 15.0)
    refill_every: int = 0
    """Every this many steps (jittered) the data loaders refill: ``data`` runs long."""
    refill_seconds: tuple[float, float] = (0.5, 2.0)
    refill_one_rank: float = 0.0
    """Chance that a refill is one rank's alone (its peers wait for it in ``comm``)."""
    early_beats: bool = True
    """Ranks beat early once a step runs past 4x their usual, as the client does."""
    fingerprint_every: int = 0
    loss_start: float = 5.0
    loss_end: float = 2.0
    loss_noise: float = 0.03
    grad_norm: float = 1.0
    grad_noise: float = 0.15
    tokens: int = 4096
    start_time: float = 1_700_000_000.0
    seed: int = 1


class SimJob:
    """One simulated job: call :meth:`steps` and :meth:`stall` to move time forward."""

    def __init__(self, cfg: SimConfig, sink: Sink, tick: Tick | None = None,
                 tick_every: float = 0.5) -> None:
        self.cfg = cfg
        self.sink = sink
        self.tick = tick
        self.tick_every = tick_every
        self.rng = random.Random(cfg.seed)
        self.now = cfg.start_time
        self.step = 0
        self.attempt = 0
        self.seq = [0] * cfg.ranks
        self.speed = [math.exp(self.rng.gauss(0.0, cfg.rank_spread)) for _ in range(cfg.ranks)]
        self.next_hb = [self.now + self.rng.random() * cfg.hb_interval for _ in range(cfg.ranks)]
        self.next_tick = self.now + tick_every
        self.slow: dict[int, float] = {}
        """rank -> compute factor (a straggler)."""
        self.silent: set[int] = set()
        self.stuck: dict[int, float] = {}
        """Ranks doing no work in their phase (a loader stuck), since when: a completed step
        ends it."""
        self.nan_ranks: dict[int, set[int]] = {}
        """step -> ranks whose loss is NaN at that step."""
        self.grad_scale: dict[int, float] = {}
        self.report_fields: dict[int, dict[int, dict[str, Any]]] = {}
        """step -> rank -> StepReport fields that replace the simulated ones."""
        self.loss_scale: dict[int, float] = {}
        self.loss_level = 1.0
        """Factor on every loss from now on (the job re-formed: another loss curve)."""
        self.world_size = 0
        """What the step reports say the world size is (0: not told, as old clients)."""
        self.lr: float | None = None
        self.fp_flip: dict[int, set[int]] = {}
        self.step_time_scale = 1.0
        self.data_extra: dict[int, float] = {}
        self.bad_batches: dict[int, dict[int, BatchFault]] = {}
        """step -> rank -> what its batch check found (the ranks skip that step when
        ``skip_bad_batches``)."""
        self.skip_bad_batches = True
        self.coll_lag: dict[int, int] = {}
        """rank -> collectives it is behind the others (a rank that never issued one)."""
        self.phase = ["idle"] * cfg.ranks
        self.phase_start = [self.now] * cfg.ranks
        self.usual: list[float | None] = [None] * cfg.ranks
        """Each rank's moving average of its step durations (the client's ``usual_step``)."""
        self.messages = 0

    def host(self, rank: int) -> str:
        return f"node-{rank // self.cfg.ranks_per_host}"

    # -- delivery -------------------------------------------------------------------------
    def _emit(self, events: list[tuple[float, int, TelemetryMessage]], until: float) -> None:
        """Deliver events and ticks in time order up to ``until``."""
        heapq.heapify(events)
        while events or (self.tick is not None and self.next_tick <= until):
            if self.tick is not None and self.next_tick <= until and (
                    not events or self.next_tick <= events[0][0]):
                self.now = self.next_tick
                self.tick(self.now)
                self.next_tick += self.tick_every
                continue
            t, _, msg = heapq.heappop(events)
            self.now = t
            self.messages += 1
            self.sink(msg)
        self.now = until

    def _heartbeats(self, start: float, until: float, phase_of: Callable[[int, float], str],
                    events: list[tuple[float, int, TelemetryMessage]],
                    quiet: frozenset[int] = frozenset()) -> None:
        """Every rank's beats in ``[start, until)``: its regular ones, and the client's early
        one once the step has run past ``STALL_BEAT_FACTOR`` x the rank's usual step
        (:meth:`RankState.stalled`). A rank in ``quiet`` does no work in its phase (a loader
        stuck): its beats say so from its first look on (:func:`looks_after`), and it beats
        once more when that has lasted ``QUIET_BEAT_S``, as the client does."""
        cfg = self.cfg
        for r in range(cfg.ranks):
            t = self.next_hb[r]
            times = []
            while t < until:
                times.append(t)
                t += cfg.hb_interval
            self.next_hb[r] = t
            usual = self.usual[r]
            if cfg.early_beats and usual is not None:
                early = start + max(STALL_BEAT_MIN_S, STALL_BEAT_FACTOR * usual)
                if early < until:
                    times = sorted([*times, early])
            if r in self.silent:
                continue
            first_look = looks_after(usual)
            if r in quiet:
                since = self.stuck.setdefault(r, start)
                told = since + first_look + QUIET_BEAT_S
                if start <= told < until:
                    times = sorted([*times, told])
            for t in times:
                phase = phase_of(r, t)
                if phase != self.phase[r]:
                    self.phase[r] = phase
                    self.phase_start[r] = t
                self.seq[r] += 1
                lag = self.coll_lag.get(r, 0)
                looked = t - self.stuck.get(r, t) - first_look
                events.append((t, len(events), Heartbeat(
                    job=cfg.job, time=t, seq=self.seq[r], rank=r, attempt=self.attempt,
                    host=self.host(r), pid=1000 + r, step=self.step, phase=phase,
                    phase_elapsed=t - self.phase_start[r], coll_seq=self.step * 2 - lag,
                    coll_done=self.step * 2 - lag,
                    quiet_for=max(0.0, looked))))

    # -- time ---------------------------------------------------------------------------
    def steps(self, n: int) -> None:
        """Run ``n`` healthy-or-faulty steps (faults as configured on this object)."""
        for _ in range(n):
            self._one_step()

    def _one_step(self) -> None:
        cfg = self.cfg
        rng = self.rng
        s = self.step
        start = self.now
        compute = []
        data = []
        for r in range(cfg.ranks):
            c = cfg.compute * self.speed[r] * math.exp(rng.gauss(0.0, cfg.jitter))
            if rng.random() < cfg.slow_step_prob:
                c *= 2.0 + rng.random()
            c *= self.slow.get(r, 1.0) * self.step_time_scale
            compute.append(c)
            data.append(cfg.data * math.exp(rng.gauss(0.0, 0.2)) + self.data_extra.get(r, 0.0))
        if cfg.refill_every and s > 0 and rng.random() < 1.0 / cfg.refill_every:
            refill = rng.uniform(*cfg.refill_seconds)
            alone = rng.random() < cfg.refill_one_rank
            for r in ([rng.randrange(cfg.ranks)] if alone else range(cfg.ranks)):
                data[r] += refill
        ev = 0.0
        if cfg.eval_every and s > 0 and s % cfg.eval_every == 0:
            ev = rng.uniform(*cfg.eval_seconds)
        busy = [ev + compute[r] + data[r] for r in range(cfg.ranks)]
        ckpt = 0.0
        if cfg.checkpoint_every and s > 0 and s % cfg.checkpoint_every == 0:
            ckpt = rng.uniform(*cfg.checkpoint_seconds)
        slowest = max(busy)
        duration = slowest + cfg.comm + ckpt
        end = start + duration

        def phase_of(r: int, t: float) -> str:
            into = t - start
            if into < ev:
                return "eval"
            into -= ev
            if into < data[r]:
                return "data"
            if into < busy[r] - ev:
                return "compute"
            if into < slowest - ev + cfg.comm:
                return "comm"
            return "checkpoint"

        events: list[tuple[float, int, TelemetryMessage]] = []
        self._heartbeats(start, end, phase_of, events)
        progress = 1.0 - math.exp(-s / 3000.0)
        loss_base = cfg.loss_start + (cfg.loss_end - cfg.loss_start) * progress
        grad = cfg.grad_norm * math.exp(rng.gauss(0.0, cfg.grad_noise)) * self.grad_scale.get(s, 1)
        nan = self.nan_ranks.get(s, set())
        bad_batches = self.bad_batches.get(s, {})
        skipped = bool(bad_batches) and self.skip_bad_batches
        for r in range(cfg.ranks):
            if r in self.silent:
                continue
            loss = loss_base * (1.0 + rng.gauss(0.0, cfg.loss_noise)) \
                * self.loss_scale.get(s, 1) * self.loss_level
            phases = {"data": data[r], "compute": compute[r],
                      "comm": duration - ckpt - busy[r]}
            if ckpt:
                phases["checkpoint"] = ckpt
            if ev:
                phases["eval"] = ev
            t = end + rng.random() * 0.002
            self.seq[r] += 1
            report = StepReport(
                job=cfg.job, time=t, seq=self.seq[r], rank=r, step=s, attempt=self.attempt,
                duration=duration, phases=phases,
                loss=None if skipped else float("nan") if r in nan else loss,
                grad_norm=None if skipped else grad, tokens=cfg.tokens, samples=8,
                world_size=self.world_size, lr=self.lr, batch_fault=bad_batches.get(r),
                skipped=skipped)
            fields = self.report_fields.get(s, {}).get(r)
            if fields:
                report = msgspec.structs.replace(report, **fields)
            events.append((t, len(events), report))
            if cfg.fingerprint_every and s % cfg.fingerprint_every == 0:
                flip = 1 if r in self.fp_flip.get(s, set()) else 0
                events.append((t, len(events), Fingerprint(
                    job=cfg.job, time=t, rank=r, step=s, checksum=123456789 + s + flip,
                    attempt=self.attempt)))
        self._emit(events, end)
        self.stuck.clear()
        self.step += 1
        for r in range(cfg.ranks):
            self.usual[r] = usual_after(self.usual[r], duration)

    def stall(self, seconds: float, phase_of: Callable[[int], str],
              quiet: frozenset[int] = frozenset()) -> None:
        """No step completes for ``seconds``; heartbeats go on with each rank's phase (the
        ranks in ``quiet`` doing no work in theirs)."""
        self.stall_at(seconds, lambda r, t: phase_of(r), quiet)

    def stall_at(self, seconds: float, phase_of: Callable[[int, float], str],
                 quiet: frozenset[int] = frozenset()) -> None:
        """:meth:`stall` where a rank's phase may change with the time ``t`` of its beat."""
        events: list[tuple[float, int, TelemetryMessage]] = []
        start, until = self.now, self.now + seconds
        self._heartbeats(start, until, phase_of, events, quiet)
        self._emit(events, until)


class Harness:
    """A :class:`Detector` on a simulated clock, fed by a :class:`SimJob`, recording output.

    ``events`` holds every anomaly change in order, as the service would publish them.
    """

    def __init__(self, th: Thresholds | None = None, cfg: SimConfig | None = None,
                 tick_every: float = 0.25) -> None:
        cfg = cfg or SimConfig()
        self.clock = cfg.start_time
        counter = itertools.count(1)
        self.detector = Detector(th or Thresholds(), clock=lambda: self.clock,
                                 new_id=lambda: f"a{next(counter)}")
        self.sim = SimJob(cfg, self.feed, self.tick, tick_every)
        self.events: list[Anomaly] = []
        self.muted = False
        """While set, nothing reaches the detector (it is disconnected): no ticks either."""

    @property
    def job(self) -> JobState:
        return self.detector.job(self.sim.cfg.job)

    def feed(self, msg: TelemetryMessage) -> None:
        self.clock = max(self.clock, msg.time)
        if not self.muted:
            self.detector.on_telemetry(msg)
            self.collect()

    def tick(self, now: float) -> None:
        self.clock = max(self.clock, now)
        if not self.muted:
            self.detector.tick(now)
            self.collect()

    def collect(self) -> list[Anomaly]:
        """Move what the detector raised since the last call into ``events``; return it."""
        if not self.detector.outbox:
            return []
        new = [t.anomaly for t in self.detector.drain()]
        self.events.extend(new)
        return new

    def opened(self, kind: str | None = None) -> list[Anomaly]:
        """Anomalies raised (first revision), optionally of one kind."""
        return [a for a in self.events if a.rev == 1 and kind in (None, a.kind)]

    def resolved(self, kind: str | None = None) -> list[Anomaly]:
        return [a for a in self.events if a.status == "resolved" and kind in (None, a.kind)]
