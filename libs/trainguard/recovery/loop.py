"""The Guard's side of in-place recovery, torch-free: the :class:`Recovery` plug point and the
iteration behind ``for step in guard.steps(start, stop)``.

``trainguard.torch.init_process_group`` installs a Recovery on the Guard. The Guard then
asks it, when an exception leaves ``with guard.step(n)``, whether that is a lost peer
(absorbed: step ``n`` is abandoned) and, at the next iteration of :func:`iterate`, to
recover, which returns the step to run next. Without a Recovery, ``guard.steps`` is
``range``: nothing is absorbed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from trainguard.contract.schemas import Command


@dataclass(frozen=True)
class CommandState:
    """What the group's collective commands made of each rank's Guard, which a replacement
    must take from its peers: it missed those commands, and they are not run again."""

    command_seq: int
    """The collective-command sequence agreed so far."""
    checkpoint_every: int
    """The checkpoint interval ``set_interval`` set (0: no periodic checkpoints)..."""
    checkpoint_from: int
    """...counted from this step. A replacement on its own default would save at other
    steps than its peers, and its save's collective would meet their step's."""
    scheduled: tuple[Command, ...] = ()
    """Collective commands held and not run yet (waiting for their ``at_step`` or an
    agreement, or not admitted yet): a ``set_interval`` sent before the replacement came."""


class Recovery(Protocol):
    """What the Guard needs of an in-place recovery (``trainguard.recovery.inplace.InPlace``)."""

    @property
    def enabled(self) -> bool:
        """This rank recovers in place (under ``trainguard launch``); False under a plain
        torchrun, where no peer waits for its replacement."""
        ...

    @property
    def generation(self) -> int:
        """The generation of the process group this rank is in now."""
        ...

    @property
    def joining(self) -> bool:
        """This rank replaces one in a running group (it takes its peers' state at
        :meth:`begin`)."""
        ...

    def absorbs(self, error: BaseException) -> bool:
        """True when ``error`` is a lost peer or failed collective this rank recovers
        from in place; False for everything else (a user error, ``DrillCrash``), and also
        when in-place is off (the recovery then says so in a RecoveryReport)."""
        ...

    def begin(self, start: int) -> int:
        """The loop starts at ``start``: returns the step to run first (a replacement rank
        takes it from its peers) and marks this rank ready to recover in place."""
        ...

    def recover(self, failed_step: int, error: BaseException) -> int:
        """Re-form the group and agree on state after ``failed_step`` was abandoned;
        returns the step to run next. Raises ``error`` when in-place recovery fails."""
        ...

    def watched_generation(self) -> int:
        """The newest generation of the job's group this rank knows of (cheap: asked at
        every command agreement; above :attr:`generation` the group re-forms there)."""
        ...

    def regroup(self, completed: int) -> int:
        """Re-form the group at a newer generation with nothing failed (a host taken back
        in place), after ``completed``; returns the step to run next."""
        ...

    def on_regroup(self, fn: Callable[[], None], *, after_sync: bool = False,
                   rebuilds_model: bool = False) -> None:
        """Run ``fn`` on every rank after a re-form: before the state agreement (a helper
        rebuilding its side group), or after it (``after_sync``: rebuilding DDP, whose
        construction broadcasts rank 0's parameters). ``rebuilds_model``: ``fn`` builds a
        sharded model again on the new group, so its state can be recovered in place from
        a replica."""
        ...

    def on_shards(self, keeper: ShardKeeper) -> None:
        """``keeper`` holds every rank's shard elsewhere too (buddy copies): a sharded
        state with no replica then recovers in place from it."""
        ...

    def on_teardown(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on a survivor before its group is torn down: it drops what holds the
        old group (DDP's reducer). A group's sockets close only when its last reference
        goes; until then a peer blocked on this rank waits out its collective timeout."""
        ...


class ShardKeeper(Protocol):
    """Where a sharded state with no replica comes back from after a re-form."""

    def restore_shards(self, completed: int, joined: bool) -> tuple[int, str, str]:
        """Collective, after the state agreement: put every rank's shard back to the
        newest step at or below ``completed`` that every shard is held at (a replacement,
        ``joined``, takes its own from the rank holding its copies), else to the committed
        checkpoint. Returns ``(step restored, tier, why not memory)``."""
        ...


class Loop:
    """The state of one ``guard.steps`` loop: where it goes next."""

    __slots__ = ("abandoned", "error", "failed_step", "next_step", "regroup")

    def __init__(self) -> None:
        self.abandoned: int | None = None
        """The step abandoned by an absorbed failure (recovered at the next iteration)."""
        self.failed_step: int | None = None
        """The first step the failure kept from completing: ``abandoned``, or the next one
        when the failure came after ``abandoned`` had completed (its command agreement)."""
        self.error: BaseException | None = None
        self.next_step: int | None = None
        """Set by a rollback in place: the step the loop continues at."""
        self.regroup = False
        """The ranks agreed on a newer generation: the group re-forms after this step."""


def iterate(loop: Loop, start: int, stop: int, recovery: Recovery | None,
            regrouped: Callable[[int], None],
            done: Callable[[int], None] = lambda step: None) -> Iterator[int]:
    """The steps ``start..stop-1``, repeated or rewound where a recovery or a rollback says
    so. ``regrouped(next_step)`` runs after every recovery and after a replacement's first
    agreement (the Guard rebuilds its command agreement and notes the step the group
    completed). A regroup the ranks agreed on (``loop.regroup``) re-forms the group after
    the step that agreed on it. ``done(step)`` runs after every step that completed and
    is followed by the next one (not after one a recovery or a rollback replaced)."""
    joining = recovery is not None and recovery.joining
    step = recovery.begin(start) if recovery is not None else start
    if joining or step != start:
        regrouped(step)
    while step < stop:
        yield step
        if loop.abandoned is not None and recovery is not None:
            failed, error = loop.failed_step, loop.error
            assert error is not None and failed is not None
            loop.error = None  # not kept alive (with its frames) across the rest of training
            step = recovery.recover(failed, error)
            loop.abandoned = loop.failed_step = None
            regrouped(step)
        elif loop.regroup and recovery is not None:
            # After a rollback too: the agreement starts from the step it rewound to.
            loop.regroup, loop.next_step = False, None
            step = recovery.regroup(step)
            regrouped(step)
        elif loop.next_step is not None:
            step, loop.next_step = loop.next_step, None
        else:
            done(step)
            step += 1
