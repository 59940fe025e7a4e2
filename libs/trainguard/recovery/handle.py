"""What the ``trainguard.torch`` helpers need of the Guard, as a Protocol.

The Checkpointer and the DDP hook are written against this, not against the concrete
:class:`~.guard.Guard`: they can be tested with a stand-in, and the Guard is free to change
what it keeps privately.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Final, Protocol

from trainguard.contract.envelope import uuid7
from trainguard.contract.schemas import (
    CheckpointReport,
    Command,
    RecoveryReport,
    ResumePoint,
    SnapshotReport,
)
from trainguard.core.identity import Identity
from trainguard.core.rankstate import RankState

from .loop import CommandState, Recovery

Handler = Callable[[Command], "str | None"]
"""What ``guard.on(kind, handler)`` runs: returns an ack detail, or None."""

RESUME_TIMEOUT: Final = 0.5
"""Bound of ``resume_point``'s question to the coordinator, connecting included. The
coordinator answers from Redis in milliseconds; a bus that is slow or down must not delay a
rank's start by more than this (``LATEST`` answers instead)."""


class GuardHandle(Protocol):
    """The part of a Guard that the torch helpers use."""

    model: Any
    optimizer: Any
    checkpoint_root: str | None
    """Where ``resume_point()`` looks for ``LATEST`` without the coordinator."""
    joining: bool
    """A replacement rank before its first agreement: its state comes from its peers."""

    @property
    def identity(self) -> Identity:
        """Who the rank is, and its attempt (reports carry it)."""
        ...

    @property
    def job(self) -> str: ...

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def state(self) -> RankState: ...

    @property
    def last_completed_step(self) -> int | None: ...

    @property
    def fingerprint_every(self) -> int:
        """Steps between the rank's parameter fingerprints (0: none)."""
        ...

    def on(self, kind: str, handler: Handler) -> None: ...

    def on_close(self, fn: Callable[[], None]) -> None: ...

    def after_step(self, fn: Callable[[float | None], None]) -> None: ...

    def each_step(self, fn: Callable[[int], None]) -> None: ...

    def drill_target(self, kind: str, fn: Callable[[dict[str, Any]], str]) -> None: ...

    def set_phase_accounting(self, fn: Callable[[dict[str, float]], None]) -> None: ...

    def publish_checkpoint_report(self, report: CheckpointReport) -> None: ...

    def publish_snapshot(self, report: SnapshotReport) -> None:
        """A verified memory snapshot (telemetry, throttled; callable from any thread)."""
        ...

    def resume_point(self, root: str | None = None, timeout: float = RESUME_TIMEOUT, *,
                     below_step: int | None = None) -> ResumePoint | None: ...

    # -- in-place recovery (trainguard.recovery.inplace, the Checkpointer's reload) ---------
    @property
    def recovery(self) -> Recovery | None: ...

    def set_recovery(self, recovery: Recovery | None) -> None: ...

    @property
    def abandoned(self) -> int | None: ...

    @property
    def regrouping(self) -> bool: ...

    @property
    def nonfinite_at(self) -> int | None: ...

    def rewind(self, next_step: int) -> None: ...

    def start(self) -> Any:
        """Connect in the background (a replacement does at once: its peers wait for its
        command subscription before they share their state)."""
        ...

    def await_commands(self, timeout: float) -> bool: ...

    @property
    def command_state(self) -> CommandState: ...

    def adopt_command_state(self, state: CommandState) -> None: ...

    def publish_recovery(self, report: RecoveryReport) -> None: ...

    def resize(self, world_size: int, rank: int | None = None) -> None:
        """The group goes on at ``world_size``, this rank as ``rank`` (a host left in
        place)."""
        ...


def recovery_report(handle: GuardHandle, **fields: Any) -> RecoveryReport:
    """A :class:`RecoveryReport` of this rank, stamped with its id, attempt and time."""
    return RecoveryReport(id=uuid7(), job=handle.job, rank=handle.rank,
                          attempt=handle.identity.attempt.restart_count, time=time.time(),
                          **fields)
