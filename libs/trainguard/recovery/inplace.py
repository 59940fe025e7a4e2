"""In-place recovery: survivors keep their processes, the group re-forms, state comes from a
peer (docs/design.md, section 10).

:func:`init_process_group` replaces the trainer's ``dist.init_process_group(...)``. Under
``trainguard launch`` it forms the group on the job store (the rendezvous ``TCPStore`` at
``MASTER_ADDR:MASTER_PORT``) under :func:`trainguard.recovery.groupstore.pg_prefix` of the rank's
generation and installs an :class:`InPlace` on the Guard. When a peer is lost, the failing
step is abandoned (``guard.step`` absorbs the error) and the next iteration of
``guard.steps`` calls :meth:`InPlace.recover`: tear the group down (NCCL: abort the
communicator first), wait for the agent to raise the generation, form the new group,
rebuild what lived on the old one (side groups, DDP), agree on the source and take its
state, and publish a RecoveryReport. Anything that fails on the way re-raises the original
error: the rank exits and the agent restarts the group cold.
"""

from __future__ import annotations

import gc
import logging
import os
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Final

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from trainguard.contract import envnames
from trainguard.contract.errors import TrainguardError
from trainguard.contract.schemas import RECOVERING_PHASE, StateKind

from . import groupstore
from .handle import GuardHandle, recovery_report
from .loop import ShardKeeper
from .peerloss import is_peer_loss
from .sharding import declaration, holding, layout_of, replica_dim, replica_groups
from .statesync import StateAgreement, Stream, agree, share_state, share_streams, source_within

log = logging.getLogger("trainguard.inplace")

POLL_S: Final = 0.01
"""How often a survivor reads the job's generation while it waits for the replacement."""
LEFT_POLL_S: Final = 0.1
"""How often it also asks whether a host left for good: every rank of a large job asks the
one store, so this second question comes ten times less often than the first."""
COMMANDS_WAIT_S: Final = 5.0
"""How long a replacement waits for its command subscription before the state agreement
(its peers wait for it meanwhile; a bus that is down costs this once)."""
NCCL_ERROR_HANDLING: Final = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
NCCL_CLEANUP_ONLY: Final = "2"
"""Abort the communicators on an error, keep the process: modes 1 and 3 tear the process
down, which would take the survivors with the failed rank."""


class RejoinFailed(TrainguardError):
    """In-place recovery could not complete (the cause of the re-raised original error)."""


def agent_store_address(env: Mapping[str, str]) -> tuple[str, int, str, int] | str:
    """``(host, port, run_id, generation)`` of the job store under ``trainguard launch``, or
    why there is none (in-place recovery is then off)."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return "the rank has no agent store (TORCHELASTIC_USE_AGENT_STORE is not True)"
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                           envnames.GENERATION) if not env.get(k)]
    if missing:
        return f"not under trainguard launch ({', '.join(missing)} unset)"
    try:
        return (env["MASTER_ADDR"], int(env["MASTER_PORT"]), env["TORCHELASTIC_RUN_ID"],
                int(env[envnames.GENERATION]))
    except ValueError as exc:
        return f"unreadable MASTER_PORT or {envnames.GENERATION}: {exc}"


def needs_abort(backend: str) -> bool:
    """NCCL's communicator is aborted before the group is destroyed: destroying it would
    wait for the collective in flight, up to the collective timeout."""
    return "nccl" in backend.lower()


def nccl_error_handling(env: Mapping[str, str]) -> str | None:
    """The ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` value an in-place NCCL rank needs, or None
    when the current one already keeps the process alive (0, 2)."""
    return None if env.get(NCCL_ERROR_HANDLING, "") in ("0", NCCL_CLEANUP_ONLY) \
        else NCCL_CLEANUP_ONLY


def teardown(backend: str) -> None:
    """Destroy the default group and every group made from it, aborting the default one
    first (NCCL would otherwise wait for the collective in flight). Closing this rank's
    connections is what makes a peer blocked on this rank (not on the lost one) fail now
    instead of after the collective timeout."""
    if not dist.is_initialized():
        return
    try:
        dist.group.WORLD.abort()  # type: ignore[union-attr]
    except Exception:
        log.debug("abort of the process group failed (%s)", backend, exc_info=True)
    try:
        dist.destroy_process_group()
    except Exception:
        log.debug("destroy_process_group failed", exc_info=True)
    # The group's sockets close when its last reference goes, and some sit in reference
    # cycles: until they close, a peer blocked on this rank waits out its timeout. The
    # failed collective's are young and cheap to collect here; the old ones (DDP's reducer
    # holds the group) need a full collection, a quarter second in a large heap, which
    # waits for the first moment this rank waits anyway (:meth:`InPlace.collect_waiting`).
    gc.collect(1)


def drop_traceback(error: BaseException) -> None:
    """Let go of the frames ``error`` (and the errors chained to it) passed through, keeping
    the traceback as text in a note. FSDP2's collectives and hooks run in Python: the frames
    of the failed step hold its modules and, through them, the process groups (HSDP's
    replicate group), whose sockets stay open while the frames live; a peer blocked on them
    waits out its collective timeout instead of failing at once. Cleared locals are not
    enough (a frame keeps its function, and a module's call wrapper is a closure over the
    module): the traceback goes."""
    seen: set[int] = set()
    err: BaseException | None = error
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if err.__traceback__ is not None:
            err.add_note("".join(traceback.format_tb(err.__traceback__)).rstrip())
            err.__traceback__ = None
        err = err.__cause__ or err.__context__


def import_group_defaults() -> None:
    """Import ``torch.distributed.nn.functional`` while no group exists.

    Its collectives take ``group=group.WORLD`` as a default argument, evaluated when the
    module is first imported, and torch imports it lazily (``torch._dynamo`` does, which
    the first optimizer a trainer builds pulls in). Imported after our group formed, ten
    functions would hold that group for good: :func:`teardown` could not close its
    sockets, and a survivor blocked on this rank would wait out its collective timeout
    instead of failing at once. Imported before any group, the defaults are ``None``.
    """
    import torch.distributed.nn.functional  # noqa: F401


def comm_device(backend: str) -> torch.device:
    """Where the agreement's tensors live: the current GPU for NCCL, else the CPU."""
    if needs_abort(backend) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Phases:
    """Where one re-form's time went: consecutive named phases, in seconds, in order (the
    recovery report carries them to the incident)."""

    def __init__(self, start: float) -> None:
        self._last = start
        self.seconds: dict[str, float] = {}

    def mark(self, name: str) -> None:
        """The phase ``name`` ends now."""
        now = time.monotonic()
        self.seconds[name] = round(self.seconds.get(name, 0.0) + now - self._last, 4)
        self._last = now


class InPlace:
    """The rank's in-place recovery (installed on the Guard as its Recovery).

    ``job_store`` None: in-place is off (``off_reason`` says why); failures are only
    reported as ``path="restart"``.
    """

    def __init__(self, guard: GuardHandle, backend: str, *, timeout: timedelta,
                 rejoin_timeout: float, job_store: Any = None, generation: int = 0,
                 off_reason: str = "", init_kwargs: Mapping[str, Any] | None = None) -> None:
        self.guard = guard
        self.backend = backend
        self.timeout = timeout
        self.rejoin_timeout = rejoin_timeout
        self.job_store = job_store
        self._generation = generation
        self._collected = True
        """Whether this re-form ran its full collection (:meth:`collect_waiting`)."""
        self.off_reason = off_reason
        self.kind: StateKind = "replicated"
        """How this rank's state is laid out (read when it declares in-place recovery): a
        sharded one is not waited for, the agents restart the group; a hybrid one only
        where the model is rebuilt on the new group (:attr:`rebuilds_model`)."""
        self.rebuilds_model = False
        """A regroup hook builds the sharded model again (``trainguard.torch.fsdp``)."""
        self._rebuildable = False
        self._kept = False
        self._keeper: ShardKeeper | None = None
        """Keeps every rank's shard on another host too (:meth:`on_shards`)."""
        self._holds: str | None = None
        """The part of the state this rank held when it last declared (:func:`holding`)."""
        self.init_kwargs = dict(init_kwargs or {})
        self.phases = Phases(time.monotonic())
        """The current re-form's phases (:meth:`_reform`)."""
        self.seen_at: float | None = None
        """When the last absorbed failure reached the step boundary (monotonic)."""
        self._seen_wall: float | None = None
        self._restart_reported: int | None = None
        """The generation whose group this rank already said it leaves for a restart."""
        self._start = 0
        self._before: list[Callable[[], None]] = []
        self._after: list[Callable[[], None]] = []
        self._streams: list[Stream] = []
        self._release: list[Callable[[], None]] = []
        self.recoveries: list[dict[str, float]] = []
        """Per recovery on this rank (benchmarks, logs): ``rejoin`` (teardown, waiting for
        the generation, forming), ``sync`` (hooks, agreement, state) and ``total`` (failure
        seen to ready) in seconds; a replacement's first agreement has only ``sync``."""

    @property
    def enabled(self) -> bool:
        return self.job_store is not None

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def joining(self) -> bool:
        return self.enabled and self.guard.joining

    # -- forming ----------------------------------------------------------------------
    def form(self, generation: int) -> None:
        """The process group of ``generation`` on its own prefix of the job store."""
        import_group_defaults()
        store = PrefixStore(groupstore.pg_prefix(generation), self.job_store)
        dist.init_process_group(self.backend, store=store, rank=self.guard.rank,
                                world_size=self.guard.world_size, timeout=self.timeout,
                                **self.init_kwargs)
        self._generation = generation

    def newest_generation(self) -> int:
        return int(self.job_store.add(groupstore.GENERATION, 0))

    def left(self, generation: int) -> str | None:
        """Why a host's ranks of ``generation`` left the job for good, if one did."""
        key = groupstore.left_key(generation)
        if not self.job_store.check([key]):
            return None
        return bytes(self.job_store.get(key)).decode(errors="replace")

    def mark_ready(self) -> None:
        """Tell the agents this rank can be recovered in place in its generation."""
        if not self.enabled:
            return
        if self.guard.model is None:
            log.warning("in-place recovery off: guard.attach(model, optimizer) was not "
                        "called before the loop")
            return
        # What the key says of this rank's state decides whether a replacement can take it
        # from a peer (the agent restarts the group at once where none holds it).
        layout = layout_of(self.guard.model, self.guard.world_size)
        self.kind = layout.topology.kind
        self._holds = holding(layout)
        # HSDP down to one replica declares "sharded": still rebuilt, so it may grow again.
        self._rebuildable = self.rebuilds_model and self.kind != "replicated" and \
            _hands_over_along_one_dim(self.guard.model)
        # FSDP over the world, rebuilt, its shards on buddies: replaced in place, never
        # resized (that would reshard every parameter).
        self._kept = self.rebuilds_model and self.kind == "sharded" and \
            self._keeper is not None
        self.job_store.set(groupstore.in_place_key(self._generation, self.guard.rank),
                           declaration(layout, rebuilds=self._rebuildable, kept=self._kept))

    # -- Recovery ---------------------------------------------------------------------
    def on_regroup(self, fn: Callable[[], None], *, after_sync: bool = False,
                   rebuilds_model: bool = False) -> None:
        (self._after if after_sync else self._before).append(fn)
        self.rebuilds_model |= rebuilds_model

    def on_shards(self, keeper: ShardKeeper) -> None:
        self._keeper = keeper

    def on_stream(self, stream: Stream) -> None:
        """``stream`` goes on at the step the group agrees on, after the state hand-over
        (a data loader's position: a survivor rewinds, a replacement takes the source's)."""
        self._streams.append(stream)

    @property
    def hands_over(self) -> bool:
        """Whether a replacement can take this rank's state from a peer: replicated state,
        a hybrid one (HSDP) whose model is rebuilt on the re-formed group, or a sharded one
        rebuilt and kept on buddies."""
        return self.kind == "replicated" or self._rebuildable or self._kept

    def on_teardown(self, fn: Callable[[], None]) -> None:
        self._release.append(fn)

    def absorbs(self, error: BaseException) -> bool:
        if not is_peer_loss(error):
            return False
        if not self.enabled:
            self._report_restart(f"in-place recovery off: {self.off_reason}", error)
            return False
        if not self.hands_over:
            # Nothing to wait for: the agents restart the group (section 10).
            why = "" if self.kind == "sharded" else \
                " (a hybrid state recovers in place where trainguard.torch.fsdp builds it)"
            self._report_restart(f"this rank's state is {self.kind}{why}: the group restarts "
                                 "from the committed checkpoint", error)
            return False
        self.seen_at, self._seen_wall = time.monotonic(), time.time()
        log.warning("trainguard: lost a peer (%s); recovering in place",
                    str(error).splitlines()[0][:300] if str(error) else type(error).__name__)
        return True

    def begin(self, start: int) -> int:
        self._start = start
        step = start
        if self.enabled and self.guard.joining:
            t0 = time.monotonic()
            if not self.guard.await_commands(COMMANDS_WAIT_S):
                log.warning("trainguard: joining without commands (the bus did not answer in "
                            "%g s): a command sent meanwhile reaches the peers only",
                            COMMANDS_WAIT_S)
            step = self._agree(None, None, joined=True)
            self.recoveries.append({"sync": time.monotonic() - t0})
            self.guard.joining = False  # from here on a survivor like the others
        self.mark_ready()
        return step

    def watched_generation(self) -> int:
        """Rank 0 reads the job's generation (one store round trip per command agreement,
        which spreads it to every rank); the others say their own."""
        if not self.enabled or self.guard.rank != 0:
            return self._generation
        try:
            return self.newest_generation()
        except Exception as exc:  # the store host is gone: a lost peer will tell
            log.debug("generation read failed: %r", exc)
            return self._generation

    def recover(self, failed_step: int, error: BaseException) -> int:
        drop_traceback(error)
        try:
            return self._reform(failed_step, self._seen_wall)
        except Exception as exc:
            self._report_restart(f"in-place recovery failed: {exc}", error,
                                 failed_step=failed_step)
            raise error from exc

    def regroup(self, completed: int) -> int:
        """The ranks agreed on a newer generation after ``completed`` with nothing failed
        (a host taken back): re-form there. A failure raises RejoinFailed: the rank exits
        and its agent restarts the group cold."""
        self.seen_at = None
        log.warning("trainguard: the job's group re-forms at a newer generation after step "
                    "%d", completed)
        try:
            return self._reform(None, time.time())
        except Exception as exc:
            self._report_restart(f"in-place regroup failed: {exc}", exc)
            raise

    def _reform(self, failed_step: int | None, since: float | None) -> int:
        state = self.guard.state
        state.enter(RECOVERING_PHASE)
        previous = self._generation
        try:
            t0 = time.monotonic()
            self.phases = Phases(self.seen_at if self.seen_at is not None else t0)
            self.phases.mark("seen")  # the failure at the step boundary -> recovery starts
            for fn in self._release:
                fn()
            self.phases.mark("release")
            teardown(self.backend)
            self.phases.mark("teardown")
            resized = self._rejoin(previous, t0 + self.rejoin_timeout)
            t1 = time.monotonic()
            step = self._agree(failed_step, since, joined=False, previous=previous,
                               resized=resized)
            t2 = time.monotonic()
        finally:
            state.phase = None
        self.recoveries.append({"rejoin": t1 - t0, "sync": t2 - t1,
                                "total": t2 - (self.seen_at or t0)})
        self.mark_ready()
        return step

    def _rejoin(self, previous: int, deadline: float) -> groupstore.Resize | None:
        """Wait for a generation above ``previous`` and form its group; if forming fails
        because the generation rose again meanwhile, form the newest one. Returns the
        resize the newest group was formed with, if a host left in place meanwhile."""
        resized: groupstore.Resize | None = None
        applied = previous  # resize records are read once each
        self._collected = False
        if self.newest_generation() <= previous:
            self.collect_waiting()  # the agent has not replaced the lost rank yet
        self._poll(lambda: self.newest_generation() > previous, deadline, left_of=previous,
                   late=f"the generation stayed {previous} for {self.rejoin_timeout:g} s: "
                        "no replacement came",
                   gone="its ranks are not replaced")
        self.phases.mark("replacement")  # the agents' decision and the replacement's start
        while True:
            generation = self.newest_generation()
            records = groupstore.read_resizes(self.job_store, applied, generation)
            if records is None:
                raise RejoinFailed(f"the job store did not answer for generation {generation}")
            for _, resize in records:
                resized = resize
                self._resize(resize)
            applied = generation
            if not self.gather(generation, deadline):
                continue  # the generation rose again meanwhile: gather for the newest
            self.phases.mark("gathered")
            try:
                self.form(generation)
                self.phases.mark("formed")
                return resized
            except Exception as exc:
                teardown(self.backend)
                if self.newest_generation() <= generation or time.monotonic() >= deadline:
                    raise RejoinFailed(f"forming generation {generation} failed: {exc}") \
                        from exc
                log.warning("generation %d rose while forming its group; forming the newest",
                            generation)

    def gather(self, generation: int, deadline: float) -> bool:
        """Wait until every rank of ``generation`` is here to form it (True), or until the
        generation rose past it (False: gather for the newest).

        ``init_process_group`` would wait for missing ranks for the whole process-group
        timeout (30 min by default): a replacement that never starts, or a host that left
        while its ranks were still counted. Here the wait ends at ``deadline`` or when a
        host says it left, with RejoinFailed.
        """
        here = groupstore.all_here_key(generation)
        if int(self.job_store.add(groupstore.arrivals_key(generation), 1)) \
                >= self.guard.world_size:
            self.job_store.set(here, "1")
        elif not self.job_store.check([here]):
            self.collect_waiting()  # ranks still to come: a blocked peer may be one
        return self._poll(lambda: self.job_store.check([here]), deadline, left_of=generation,
                          late=f"not every one of the {self.guard.world_size} ranks of "
                               f"generation {generation} came within "
                               f"{self.rejoin_timeout:g} s",
                          gone="its ranks do not come", moved_past=generation)

    def collect_waiting(self) -> None:
        """The full collection :func:`teardown` leaves, once per re-form, where this rank
        waits anyway (for the generation, or for ranks to gather): it frees what is left of
        the old group, so a peer blocked on this rank's sockets fails now."""
        if not self._collected:
            self._collected = True
            gc.collect()

    def _poll(self, ready: Callable[[], bool], deadline: float, *, left_of: int, late: str,
              gone: str, moved_past: int | None = None) -> bool:
        """Poll ``ready`` every :data:`POLL_S` until it holds (True). Every
        :data:`LEFT_POLL_S` it also asks whether a host left generation ``left_of`` for
        good and, with ``moved_past``, whether the generation rose past it (False).
        RejoinFailed at ``deadline`` (``late``) or when a host left (``gone``)."""
        next_left = time.monotonic()
        while not ready():
            now = time.monotonic()
            if now >= deadline:
                raise RejoinFailed(late)
            if now >= next_left:
                next_left = now + LEFT_POLL_S
                if (why := self.left(left_of)) is not None:
                    raise RejoinFailed(f"{why}: {gone}, so the group restarts at the world "
                                       "size that is left")
                if moved_past is not None and self.newest_generation() > moved_past:
                    return False
            time.sleep(POLL_S)
        return True

    def _resize(self, resize: groupstore.Resize) -> None:
        """A host left and the group goes on without it: this rank's number closes up the
        gap its ranks left."""
        rank = resize.new_rank(self.guard.rank)
        if rank is None:
            raise RejoinFailed(f"this rank's host leaves the job ({resize.reason})")
        log.warning("trainguard: the group goes on at %d ranks, this one as rank %d (%s)",
                    resize.world_size, rank, resize.reason)
        self.guard.resize(resize.world_size, rank)

    def _agree(self, failed_step: int | None, failure_time: float | None, *, joined: bool,
               previous: int | None = None, resized: groupstore.Resize | None = None) -> int:
        """Run the regroup hooks, agree on the source, take its state; returns the step to
        run next. Group rank 0 publishes the RecoveryReport."""
        g = self.guard
        if not joined:  # a replacement ran these as it constructed its helpers
            for fn in self._before:
                fn()
            self.phases.mark("rebuilt")
        completed = None if joined or self._moved() else (
            g.last_completed_step if g.last_completed_step is not None else self._start - 1)
        device = comm_device(self.backend)
        agreed = agree(completed, failed_step, failure_time, g.command_state, device)
        self.phases.mark("agreed")
        restored, tier, why_not = agreed.completed, "", ""
        if self._keeper is not None and \
                layout_of(g.model, g.world_size).topology.kind == "sharded":
            # No replica holds a lost shard: every rank goes back to the newest step whose
            # every shard is held (own snapshot, or the buddy's copy), else to the disk.
            restored, tier, why_not = self._keeper.restore_shards(agreed.completed, joined)
            source = agreed.source
        else:
            source = self._share(agreed, device)
        share_streams(self._streams, restored + 1, agreed.source, device,
                      bool(agreed.joined))
        self.phases.mark("state")
        g.adopt_command_state(agreed.command_state)
        for fn in self._after:
            fn()
        self.phases.mark("after")
        step = restored + 1
        if dist.get_rank() == 0:
            seconds = time.time() - agreed.failure_time if agreed.failure_time else 0.0
            kind = "replace" if resized is None else "grow" if resized.grows else "resize"
            reason = resized.reason if resized is not None else "a peer was lost"
            if tier:
                reason += f"; shards from {tier}" + (f": {why_not}" if why_not else "")
            g.publish_recovery(recovery_report(
                g, kind=kind, path="in_place", reason=reason, tier=tier,
                generation=self._generation,
                previous_generation=previous if previous is not None else self._generation - 1,
                world_size=dist.get_world_size(), joined=agreed.joined,
                source_rank=source, failed_step=agreed.failed_step,
                last_completed=agreed.completed, resumed_step=step,
                steps_lost=max(0, agreed.completed - step + 1), seconds=seconds,
                phases={} if joined else dict(self.phases.seconds)))
        log.info("in place: generation %d, source rank %d, continuing at step %d",
                 self._generation, source, step)
        return step

    def _moved(self) -> bool:
        """Whether this rank, rebuilt on a resized group, now holds another shard than the
        state it kept: it then takes its shard from a holder, as a replacement does."""
        if self._holds is None or self.kind == "replicated" or self.guard.model is None:
            return False
        now = holding(layout_of(self.guard.model, self.guard.world_size))
        if now == self._holds:
            return False
        log.warning("trainguard: this rank holds %s on the re-formed group, not %s: it takes "
                    "that shard from a rank that holds it", now, self._holds)
        return True

    def _share(self, agreed: StateAgreement, device: torch.device) -> int:
        """Hand the state over: replicated state from the source to every rank; sharded
        state within each replica group that has a replacement, from a rank of that group.
        Returns the source of the first replacement's group (the report's)."""
        g = self.guard
        where = replica_dim(g.model.parameters())
        if where is None:
            share_state(g.model, g.optimizer, agreed.source, device)
            return agreed.source
        mesh, dim = where
        groups = replica_groups(mesh.mesh.tolist(), dim)
        sources = [source_within(agreed, members) for members in groups]
        mine = next(i for i, members in enumerate(groups) if dist.get_rank() in members)
        if set(groups[mine]) & set(agreed.joined):
            share_state(g.model, g.optimizer, sources[mine], device,
                        group=mesh.get_group(dim))
        first = agreed.joined[0] if agreed.joined else None
        return next((sources[i] for i, members in enumerate(groups) if first in members),
                    agreed.source)

    def _report_restart(self, reason: str, error: BaseException,
                        failed_step: int | None = None) -> None:
        """Best effort: the rank is about to exit with ``error``. Once per generation: a
        lost peer seen in the command agreement is seen again in the next collective."""
        if self._restart_reported == self._generation:
            return
        self._restart_reported = self._generation
        try:
            g = self.guard
            self.guard.publish_recovery(recovery_report(
                g, kind="replace", path="restart",
                reason=f"{reason} ({type(error).__name__})"[:2000],
                generation=self._generation, previous_generation=self._generation,
                world_size=g.world_size, failed_step=failed_step,
                last_completed=g.last_completed_step))
        except Exception:
            log.debug("recovery report failed", exc_info=True)


def _hands_over_along_one_dim(model: Any) -> bool:
    try:
        return replica_dim(model.parameters()) is not None
    except ValueError as exc:
        log.warning("trainguard: a lost rank's shard cannot be handed over in place: %s", exc)
        return False


def init_process_group(guard: GuardHandle, backend: str = "gloo", *,
                       timeout: timedelta | float | None = None, rejoin_timeout: float = 60.0,
                       **init_kwargs: Any) -> InPlace:
    """``dist.init_process_group`` for a trainer that recovers in place.

    Under ``trainguard launch`` the group forms on the job store, under the prefix of the
    rank's generation (a replacement, ``TRAINGUARD_JOIN=peers``, takes the newest one).
    Elsewhere (plain torchrun) it is a plain ``dist.init_process_group`` and in-place is off:
    logged once, and said in the RecoveryReport if a peer is lost.

    Args:
        guard: the rank's Guard; the recovery is installed on it.
        backend: ``gloo``, ``nccl`` or ``cpu:gloo,cuda:nccl``.
        timeout: the process group's timeout (seconds or a timedelta); default torch's.
        rejoin_timeout: how long a survivor waits for the replacement's generation.
        init_kwargs: passed on to ``dist.init_process_group`` (``device_id``, ...).
    """
    pg_timeout = timeout if isinstance(timeout, timedelta) or timeout is None \
        else timedelta(seconds=timeout)
    where = agent_store_address(os.environ)
    if isinstance(where, str):
        log.warning("trainguard: in-place recovery off: %s", where)
        guard.joining = False  # no peers to take state from: resume as a restart does
        kwargs = dict(init_kwargs)
        if pg_timeout is not None:
            kwargs["timeout"] = pg_timeout
        dist.init_process_group(backend, **kwargs)
        recovery = InPlace(guard, backend, timeout=pg_timeout or timedelta(minutes=30),
                           rejoin_timeout=rejoin_timeout, off_reason=where)
        guard.set_recovery(recovery)
        return recovery
    host, port, run_id, generation = where
    if needs_abort(backend) and (mode := nccl_error_handling(os.environ)) is not None:
        log.info("trainguard: %s=%s so that a lost peer aborts NCCL without ending this "
                 "process", NCCL_ERROR_HANDLING, mode)
        os.environ[NCCL_ERROR_HANDLING] = mode
    pg_timeout = pg_timeout or timedelta(minutes=30)
    store = TCPStore(host, port, is_master=False, timeout=pg_timeout,
                          wait_for_workers=False)
    job_store = PrefixStore(groupstore.job_prefix(run_id), store)
    recovery = InPlace(guard, backend, timeout=pg_timeout, rejoin_timeout=rejoin_timeout,
                       job_store=job_store, generation=generation, init_kwargs=init_kwargs)
    if guard.joining:
        # Its bus connection comes while the group forms and the trainer builds its model:
        # the state agreement waits for it (InPlace.begin), and its peers with it.
        guard.start()
        # Its peers wait in InPlace.gather for every rank of the new generation.
        deadline = time.monotonic() + rejoin_timeout
        generation = max(generation, recovery.newest_generation())
        while not recovery.gather(generation, deadline):
            generation = recovery.newest_generation()
    recovery.form(generation)
    guard.set_recovery(recovery)
    return recovery
