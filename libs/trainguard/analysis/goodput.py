"""Goodput (ETTR, effective training time ratio) of a large synchronous job, simulated.

ETTR is the share of wall time that ends up as training progress kept. A job of ``gpus``
GPUs fails at the rate of Llama 3's 419 unexpected interruptions in 54 days on 16,384
GPUs (:data:`LLAMA3_INTERRUPTIONS`, "The Llama 3 Herd of Models", Table 5), scaled
linearly with the GPU count. Each root-cause category maps to a :class:`Fault` class, and
a :class:`System` gives per class the :class:`Path` it recovers by: seconds to detect,
seconds to recover, and what work it redoes (nothing, a few steps from a memory snapshot,
or everything since the last committed checkpoint).

:func:`simulate` is a seeded Monte Carlo over wall time: failures arrive as independent
Poisson processes per category; between them the job trains and saves every ``interval``
seconds of training (each save blocks the loop ``save_cost`` seconds, and a failure during
a save loses it). A restart from a checkpoint loses the progress since the last committed
save. A failure that comes during a recovery starts that recovery over. The interval is
whatever rule the caller passes (the coordinator's Young/Daly rule), evaluated at the
job's true MTBF, so the model checkpoints as the product would.

Scale: the recovery times a system is given are measured at a handful of ranks. What grows
with the job is explicit: ``restart_growth`` seconds are added to every recovery that
restarts the whole group (rendezvous, process start and checkpoint load at thousands of
ranks), ``reform_growth`` to every in-place re-form of the process group (a rollback
re-forms nothing and grows by neither).

Kept out of this module: which figures describe which product (the caller's, from its
measurements) and the interval rule itself (a parameter), so the model stays pure.
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["LLAMA3_DAYS", "LLAMA3_GPUS", "LLAMA3_INTERRUPTIONS", "Breakdown", "Category",
           "Fault", "Interval", "Path", "Recovery", "Result", "System", "fault_rates",
           "mtbf", "simulate"]


class Fault(enum.StrEnum):
    """What a root cause does to the job, which decides the recovery path."""

    RANK_LOST = "rank lost"
    """One GPU's process dies (an Xid, an uncorrectable ECC error): its host stays."""
    HOST_LOST = "host lost"
    """A host, or its network, goes: every rank on it is gone at once."""
    JOB_CRASH = "job crash"
    """Every rank fails (a software bug): no survivor holds state to recover from."""
    HANG = "hang"
    """A rank stops without exiting; its peers wait in a collective."""
    SDC = "sdc"
    """Wrong numbers, nothing stops: only a check of the values finds it."""


@dataclass(frozen=True)
class Category:
    """One row of a published interruption table."""

    name: str
    count: int
    fault: Fault


LLAMA3_GPUS = 16_384
LLAMA3_DAYS = 54
LLAMA3_INTERRUPTIONS: tuple[Category, ...] = (
    Category("Faulty GPU", 148, Fault.RANK_LOST),
    Category("GPU HBM3 memory", 72, Fault.RANK_LOST),
    Category("Software bug", 54, Fault.JOB_CRASH),
    Category("Network switch/cable", 35, Fault.HOST_LOST),
    Category("Host maintenance (unplanned)", 32, Fault.HOST_LOST),
    Category("GPU SRAM memory", 19, Fault.RANK_LOST),
    Category("GPU system processor", 17, Fault.RANK_LOST),
    Category("NIC", 7, Fault.HOST_LOST),
    Category("NCCL watchdog timeouts", 7, Fault.HANG),
    Category("Silent data corruption", 6, Fault.SDC),
    Category("GPU thermal interface + sensor", 6, Fault.RANK_LOST),
    Category("SSD", 3, Fault.HOST_LOST),
    Category("Power supply", 3, Fault.HOST_LOST),
    Category("Server chassis", 2, Fault.HOST_LOST),
    Category("IO expansion board", 2, Fault.HOST_LOST),
    Category("Dependency", 2, Fault.JOB_CRASH),
    Category("CPU", 2, Fault.HOST_LOST),
    Category("System memory", 2, Fault.HOST_LOST),
)
"""Llama 3 405B pre-training, 54 days on 16,384 H100s: 419 unexpected interruptions by
root cause ("The Llama 3 Herd of Models", Meta, 2024, Table 5). The fault class is this
model's reading of each cause."""


class Recovery(enum.StrEnum):
    """What a recovery costs beyond its seconds, and whether the job's scale grows it."""

    IN_PLACE = "in place"
    """Survivors keep their state; the lost ranks are replaced or dropped: nothing redone."""
    ROLLBACK = "rollback"
    """In place, back to a memory snapshot a few steps old: ``rework`` seconds redone."""
    RESTART = "restart"
    """Every rank restarts from the last committed checkpoint: what followed it is redone."""
    UNDETECTED = "undetected"
    """Nothing notices: no time is lost on the clock (the damage is to the model)."""


@dataclass(frozen=True)
class Path:
    """How one system recovers from one fault class."""

    detect: float
    """Seconds from the fault to its detection."""
    recover: float
    """Seconds from detection to training again (at the measured scale)."""
    recovery: Recovery
    rework: float = 0.0
    """Seconds of training redone on a :attr:`Recovery.ROLLBACK`."""


@dataclass(frozen=True)
class System:
    name: str
    paths: Mapping[Fault, Path]


Interval = Callable[[float, float], float]
"""(save cost, MTBF) -> seconds of training between checkpoints."""


@dataclass
class Breakdown:
    """Where the wall time went, in seconds; the fields sum to the horizon."""

    useful: float = 0.0
    checkpoint: float = 0.0
    rework: float = 0.0
    detection: float = 0.0
    recovery: float = 0.0

    @property
    def total(self) -> float:
        return self.useful + self.checkpoint + self.rework + self.detection + self.recovery


@dataclass(frozen=True)
class Result:
    system: str
    ettr: float
    interval: float
    failures: int
    undetected: int
    """SDCs that the system never noticed (counted as useful time)."""
    spent: Breakdown = field(default_factory=Breakdown)
    """Where the wall time went."""


def fault_rates(gpus: int, categories: Sequence[Category] = LLAMA3_INTERRUPTIONS,
                ) -> dict[Fault, float]:
    """Failures per second of each class for a job of ``gpus`` GPUs: the published counts
    over the published period, scaled linearly with the GPU count (each GPU, and the host
    share that comes with it, fails independently at Llama 3's rate)."""
    scale = gpus / LLAMA3_GPUS / (LLAMA3_DAYS * 86_400.0)
    rates: dict[Fault, float] = {}
    for c in categories:
        rates[c.fault] = rates.get(c.fault, 0.0) + c.count * scale
    return rates


def mtbf(rates: Mapping[Fault, float]) -> float:
    """The job's mean time between failures of any class (inf with none)."""
    total = sum(rates.values())
    return math.inf if total <= 0 else 1.0 / total


class _Job:
    """The training loop's state between failures: progress since the last commit."""

    def __init__(self, interval: float, save_cost: float, lost: Breakdown) -> None:
        self.interval, self.save_cost, self.lost = interval, save_cost, lost
        self.pending = 0.0
        """Training seconds since the last committed checkpoint."""

    def run(self, seconds: float) -> None:
        """Train (and save on schedule) for ``seconds`` of wall time."""
        t, c, lost = self.interval, self.save_cost, self.lost
        first = t - self.pending
        if seconds < first:
            self.pending += seconds
            return
        if seconds < first + c:  # a save in progress when time runs out: not committed
            self.pending = t
            lost.checkpoint += seconds - first
            return
        lost.useful += t
        lost.checkpoint += c
        rest = seconds - first - c
        cycles = math.floor(rest / (t + c))
        lost.useful += cycles * t
        lost.checkpoint += cycles * c
        rest -= cycles * (t + c)
        if rest < t:
            self.pending = rest
        else:
            self.pending = t
            lost.checkpoint += rest - t

    def fail(self, path: Path) -> None:
        """What the failure takes from the progress made since the last commit."""
        if path.recovery is Recovery.RESTART:
            self.lost.rework += self.pending
            self.pending = 0.0
        elif path.recovery is Recovery.ROLLBACK:
            redone = min(self.pending, path.rework)
            self.lost.rework += redone
            self.pending -= redone


def _arrivals(rates: Mapping[Fault, float], seconds: float, rng: random.Random,
              ) -> list[tuple[float, Fault]]:
    events: list[tuple[float, Fault]] = []
    for fault in sorted(rates):  # a fixed order: one seed, one history
        rate, t = rates[fault], 0.0
        while rate > 0:
            t += rng.expovariate(rate)
            if t >= seconds:
                break
            events.append((t, fault))
    events.sort()
    return events


def simulate(system: System, *, gpus: int, seconds: float, save_cost: float,
             interval: Interval, seed: int, restart_growth: float = 0.0,
             reform_growth: float = 0.0,
             categories: Sequence[Category] = LLAMA3_INTERRUPTIONS) -> Result:
    """One seeded history of ``seconds`` of wall time; the same seed gives every system
    the same failures at the same times (common random numbers), so systems compare on
    the same history."""
    rates = fault_rates(gpus, categories)
    period = interval(save_cost, mtbf(rates))
    lost = Breakdown()
    job = _Job(period, save_cost, lost)
    now = 0.0  # the wall time up to which every second is accounted for
    detected_at = down_until = 0.0  # the current recovery's detection and end
    undetected = 0
    events = _arrivals(rates, seconds, random.Random(seed))
    for at, fault in events:
        path = system.paths[fault]
        if path.recovery is Recovery.UNDETECTED:  # the clock runs on as if nothing happened
            undetected += 1
            continue
        if at >= down_until:
            job.run(at - now)
        else:  # a failure during a recovery ends it here and starts the next one
            _trim(lost, down_until - at, down_until - detected_at)
            down_until = at
        job.fail(path)
        grow = {Recovery.RESTART: restart_growth, Recovery.IN_PLACE: reform_growth}.get(
            path.recovery, 0.0)
        detected_at = at + path.detect
        down_until = detected_at + path.recover + grow
        lost.detection += path.detect
        lost.recovery += path.recover + grow
        now = down_until
    if down_until > seconds:  # the horizon fell inside a recovery: cut its unspent part
        _trim(lost, down_until - seconds, down_until - detected_at)
    else:
        job.run(seconds - now)
    lost.useful += job.pending
    return Result(system.name, lost.useful / seconds, period, len(events), undetected, lost)


def _trim(lost: Breakdown, excess: float, recovering: float) -> None:
    """Take back the unspent ``excess`` seconds of the current recovery, whose last
    ``recovering`` seconds were recovery (the rest before them detection)."""
    cut = min(recovering, excess)
    lost.recovery -= cut
    lost.detection -= excess - cut
