"""``trainguard.torch.Checkpointer``: sharded checkpoints with DCP, reported to the coordinator.

Why it is built the way it is (docs/design.md, section 7):

* Every DCP collective runs on a **side gloo group** created at construction with a short
  timeout, never on the training group: ``dcp.async_save`` on the default group beside
  the training all-reduces deadlocks. A peer that never joins a save then costs this rank a
  failed report after ``timeout`` seconds instead of a hung job.
* Model and optimizer state go through ``get_state_dict``/``set_state_dict``: a fresh
  optimizer's plain ``state_dict()`` has no state entries, and DCP would silently load
  nothing into it.
* RNG states and ``extra`` are per rank, under rank-specific keys: DCP de-duplicates equal
  keys across ranks, so a shared key would keep one rank's state and lose the others'.
* Saves are asynchronous where DCP allows it: the loop pays the staging copy, a background
  thread waits for the write, computes a CRC32 of each file this rank wrote and publishes a
  :class:`CheckpointReport` on ``<prefix>.<job>.ckpt.<rank>``. The coordinator commits
  the step once every rank's report verifies.

Layout: ``<root>/<job>/step-<S>/`` holding DCP's ``__<rank>_<n>.distcp`` files and
``.metadata`` (written by the group's rank 0). A rank's files are those whose name starts
with ``__<its group rank>_``; ``.metadata`` is attributed to group rank 0. An incremental
save (``incremental=N``, :mod:`.increments`) also holds ``INCREMENT``, naming the full save
whose files hold the tensors it did not write.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.checkpoint.staging import DefaultStager

from trainguard.contract import envnames, timeline
from trainguard.contract.checksum import METADATA_FILE, file_digest
from trainguard.contract.codec import decode_durable, encode_durable
from trainguard.contract.envelope import uuid7
from trainguard.contract.envnames import flag
from trainguard.contract.errors import ConfigError, TrainguardError
from trainguard.contract.increment import INCREMENT_FILE, Increment, encode_increment
from trainguard.contract.rpc import MEMORY_ONLY
from trainguard.contract.runrecord import DATA_POLICIES, DatasetManifest, RunRecord
from trainguard.contract.schemas import (
    CheckpointReport,
    Command,
    FileDigest,
    ResumePoint,
    SnapshotReport,
    Topology,
)
from trainguard.core.files import write_atomically
from trainguard.recovery.handle import RESUME_TIMEOUT, GuardHandle, recovery_report

from .buddy import Buddies
from .data import Batches
from .increments import Chain, RankView, decide, digests, graft, only, without
from .snapshots import Every, MemorySnapshots, Snapshot
from .stats import state_layout
from .trusted import (
    CheckpointRefused,
    confine,
    encode_py_rng,
    from_blob,
    open_chain,
    reader_for,
    restore_py_rng,
    safe_load_planner,
    to_blob,
    verify_files,
)

log = logging.getLogger("trainguard.checkpoint")

STEP_KEY = "trainguard"
_STEP_DIR = re.compile(r"step-(\d+)")

ExtraFn = Callable[[], Mapping[str, Any] | None]
DCP_MODULES = (
    "torch.distributed.checkpoint.filesystem", "torch.distributed.checkpoint.staging",
    "torch.distributed.checkpoint.state_dict", "torch.distributed.checkpoint.state_dict_loader",
    "torch.distributed.checkpoint.state_dict_saver", "torch.distributed.checkpoint.default_planner",
)
"""DCP costs ~0.7-2 s to import (all of it comes with its ``staging`` module): a rank pays it
in the background once its first step is done (see :func:`warm_up`), or at its first save
or load, never before its first step unless that step loads a checkpoint."""

WARM_UP_AFTER = 60.0
"""Seconds a Checkpointer waits for the first step before importing DCP regardless (a
trainer that never enters ``guard.step``)."""


def warm_up(ready: Callable[[], bool] | None = None,
            wait_at_most: float = WARM_UP_AFTER) -> threading.Thread:
    """Import DCP on a background thread, once ``ready()`` is true (polled every 50 ms) or
    ``wait_at_most`` seconds passed; a save or load that comes first imports it itself."""
    import importlib

    def _load() -> None:
        deadline = time.monotonic() + wait_at_most
        while ready is not None and not ready() and time.monotonic() < deadline:
            time.sleep(0.05)
        for name in DCP_MODULES:
            try:
                importlib.import_module(name)
            except Exception:  # the save or load that needs it reports the error
                return

    thread = threading.Thread(target=_load, name="trainguard-dcp-import", daemon=True)
    thread.start()
    return thread


def _save_errors() -> tuple[type[BaseException], ...]:
    """DCP's ``CheckpointException`` derives from BaseException, not Exception."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def step_dir(root: str | os.PathLike[str], job: str, step: int) -> Path:
    """``<root>/<job>/step-<S>``: the layout the coordinator derives LATEST's place from."""
    return Path(root) / job / f"step-{step}"


def rank_files(names: list[str] | set[str], group_rank: int) -> list[str]:
    """The files of one save that ``group_rank`` wrote: DCP names them ``__<rank>_<n>.distcp``
    and the coordinator rank (0) writes ``.metadata``."""
    prefix = f"__{group_rank}_"
    mine = sorted(n for n in names if n.startswith(prefix))
    if group_rank == 0:
        mine.append(METADATA_FILE)
    return mine


def _rng_state() -> dict[str, Any]:
    """This process's RNG streams: torch (and CUDA where in use) as tensors, Python and
    numpy as one msgspec blob (DCP would flatten their tuples into hundreds of keys)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "py": encode_py_rng()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return state


def _set_rng_state(state: Mapping[str, Any]) -> bool:
    """False when the Python/numpy part is an older trainguard's pickle (left unset)."""
    if not restore_py_rng(state["py"]):
        return False
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(cuda))
    return True


class _SaveContext(NamedTuple):
    """What a save is reported under, taken at its start: an in-place re-form may renumber
    the rank, and a reload restart its state, before the save is done."""

    rank: int
    group_rank: int
    world_size: int
    group_token: str
    state_since: float
    topology: Topology | None


class NoCheckpointLoads(TrainguardError):
    """Committed checkpoints exist and none of them loads: starting from step 0 instead
    would throw the job's progress away silently, so the rank stops and says why."""


class Checkpointer:
    """Saves and loads sharded checkpoints and answers the coordinator's ``save_now``.

    Construct it at the same point on every rank, after ``init_process_group``: creating
    the side group is a collective. ``save`` is collective too: every rank calls it for the
    same step (``guard.should_checkpoint(step)`` is identical on every rank, and
    ``save_now`` runs at the same step everywhere).

    Args:
        guard: the rank's Guard; reports go through it and ``save_now`` is registered on it.
        root: the checkpoint root; checkpoints go to ``<root>/<job>/step-<S>/``.
        process_group: a gloo group spanning every rank for DCP's collectives; default: a
            new side group with ``timeout``.
        timeout: seconds a DCP collective may wait for a peer before the save fails.
        use_async: save with ``dcp.async_save`` (the loop pays only the staging copy).
        cache_staging: keep the staging copy's CPU memory between saves (one copy of this
            rank's state stays allocated) instead of allocating it anew for every save:
            for a 1.2 GB state on a CPU host this cuts the loop's stall several-fold.
        extra_fn: returns this rank's ``extra`` for saves the coordinator asks for (and
            for memory snapshots).
        memory: memory snapshots every this many steps of ``guard.steps`` (``"auto"``:
            from the measured copy cost, at most 5% of step time), the tier a rollback in
            place takes before the disk (:mod:`.snapshots`); None: none.
        memory_keep: memory snapshots kept (host memory: this many copies of the state);
            besides the newest, they lie at least 10 s apart.
        data: the rank's :class:`~.data.Batches`: its position goes into every checkpoint
            and memory snapshot, and comes back with them (no sample repeated or skipped).
        manifest: the data set's manifest (``trainguard data manifest``; a file or a
            :class:`~trainguard.contract.runrecord.DatasetManifest`): every rank checks its
            copy of the data against it in :meth:`resume` (sizes; sampled blocks of a
            sampled manifest), and ``data_policy`` ``refuse`` stops the job on any
            difference, on every rank, before a step; ``alert`` logs it and goes on.
        run_config: the trainer's configuration (JSON-able), kept in the run record
            (``run.json``: code version, packages, hardware, environment, seeds, manifest)
            that group rank 0 writes beside every checkpoint (``trainguard runs show``).
        saver: how a ``save_now`` saves when a framework writes its own checkpoints (the
            Lightning and Hugging Face callbacks): ``saver(S)`` saves completed step S, or
            arranges the save of a later step (a framework that saves only at a step's
            end), and returns the step it saves, which it then reports with :meth:`commit`.
            Default: :meth:`save` of the attached model and optimizer.
        incremental: after each full save, up to this many incremental ones, which write
            only the model and optimizer tensors whose bytes differ from the full save's
            (a frozen base, an adapter's untouched layers, ...) and leave the rest to it
            (:mod:`.increments`); then a full save again. A restore reads the increment and
            its base. Default ``TRAINGUARD_CHECKPOINT_INCREMENTAL``, else 0: every save is
            full.
        buddy: with memory snapshots, also send each to a buddy rank on another host and
            keep the last two copies of the buddy's (:mod:`.buddy`). Default
            ``TRAINGUARD_SNAPSHOT_BUDDY``, else off.
        failure_domain: this rank's host's failure domain (a switch, a rack): buddies are
            chosen in another one where every rank names one.
    """

    def __init__(self, guard: GuardHandle, root: str | os.PathLike[str], *,
                 process_group: dist.ProcessGroup | None = None, timeout: float = 60.0,
                 use_async: bool = True, cache_staging: bool = True,
                 extra_fn: ExtraFn | None = None, memory: Every | None = "auto",
                 memory_keep: int = 3, data: Batches | None = None,
                 manifest: DatasetManifest | str | os.PathLike[str] | None = None,
                 data_policy: str = "refuse", run_config: Mapping[str, Any] | None = None,
                 saver: Callable[[int], int] | None = None,
                 incremental: int | None = None, buddy: bool | None = None,
                 failure_domain: str | None = None) -> None:
        incremental = incremental if incremental is not None else _env_incremental()
        if isinstance(incremental, bool) or not isinstance(incremental, int) or incremental < 0:
            raise ConfigError(f"incremental={incremental!r}: the number of incremental saves "
                              "between full ones, an integer >= 0 (0: every save is full)")
        if data_policy not in DATA_POLICIES:
            raise ConfigError(f"data_policy={data_policy!r}: refuse (stop the job) or alert "
                              "(log and go on) when the data differs from the manifest")
        self.guard = guard
        self.root = Path(root)
        self.use_async = use_async
        self.extra_fn = extra_fn
        self.data = data
        self.manifest = manifest
        self.data_policy = data_policy
        self.run_config = run_config
        self.saver = saver
        self.chain = Chain(incremental)
        """This rank's base for incremental saves (:class:`.increments.Chain`)."""
        self.run_record: RunRecord | None = None
        """What group rank 0 writes as ``run.json`` (collected at its first save, off the
        training thread)."""
        self.distributed = dist.is_available() and dist.is_initialized()
        self._timeout = timeout
        self._own_group = process_group is None
        if self.distributed and process_group is None:
            process_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        self.group = process_group
        self.group_rank = dist.get_rank(self.group) if self.distributed else 0
        self.world_size = dist.get_world_size(self.group) if self.distributed else 1
        self.group_token = self._agree_group_token()
        """This worker group's id, the same on every rank of it and new at each re-form:
        the coordinator keeps one round of a step's reports per group token. torchrun's
        restart count cannot serve: each node's agent keeps its own, and a membership
        change restarts a group without counting, so the nodes' counts drift apart."""
        self.reports: list[CheckpointReport] = []
        """Reports this rank published, newest last (for tests and logs)."""
        self.state_since = time.time()
        """When this rank's model and optimizer state last started over: made by this
        process, or loaded (:meth:`load`). Each save reports it, so the coordinator can tell
        a save from state restored after a rollback from one of the state rolled back from."""
        self.loaded_extra: Any = None
        """This rank's ``extra`` from the last :meth:`load`, or None."""
        self._model: Any = None
        self._optimizer: Any = None
        self._layout: tuple[Any, Topology | None] | None = None
        self._last_step: int | None = None
        self._pending: Future[CheckpointReport] | None = None
        self._broken = ""
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainguard-ckpt")
        self._stager: DefaultStager | None = None
        self._cache_staging = use_async and cache_staging
        # DCP loads once the first step is done, so it takes nothing from the rank's start.
        warm_up(lambda: guard.last_completed_step is not None)
        self._lock = threading.Lock()
        self._snapshot_seq = 0
        self.memory = MemorySnapshots(
            memory, memory_keep, rng=_rng_state, set_rng=_set_rng_state,
            position=data.position if data is not None else None,
            set_position=data.restore if data is not None else None,
            on_checked=self._snapshot_checked) \
            if memory is not None else None
        """This rank's memory snapshots (None: off)."""
        self.failure_domain = failure_domain
        self.buddies: Buddies | None = None
        """This rank's buddy copies (None: off, or no memory snapshots)."""
        if self.memory is not None:
            guard.each_step(self._snapshot)
            if (buddy if buddy is not None else flag(os.environ, envnames.SNAPSHOT_BUDDY)) \
                    and self.distributed:
                self.buddies = Buddies(guard.rank, bind=_buddy_address(guard.identity.host))
                self._pair_buddies()
                if guard.recovery is not None:
                    guard.recovery.on_shards(self)
                buddies = self.buddies
                guard.drill_target("corrupt_copies", lambda params: buddies.corrupt())
        guard.checkpoint_root = str(self.root)
        guard.on("save_now", self._on_save_now)
        guard.on("reload", self._on_reload)
        guard.on_close(self.close)  # guard.close() finishes the save in flight first
        if guard.recovery is not None:
            # A replacement builds the side group here, at construction; its survivors at
            # the same point of their recovery (before the state agreement).
            guard.recovery.on_regroup(self._regroup)

    def _regroup(self) -> None:
        """The process group was re-formed in place: the side group went with the old one."""
        try:
            self.wait(self._timeout)
        except _save_errors() as exc:
            log.warning("the save in flight at the re-form failed: %s", _describe(exc))
            self._pending = None
        world = self.world_size
        self.chain.forget()  # so may the shards the base's digests were taken of
        if not self._own_group:
            self._broken = "the process group passed to the Checkpointer did not survive " \
                           "the in-place re-form; let it make its own"
            return
        self._broken = ""
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self._timeout))
        self.group_rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.group_token = self._agree_group_token()
        if self.memory is not None and self.world_size != world:
            self.memory.clear()  # ranks and shards moved
        if self.buddies is not None:
            self._pair_buddies()

    def _agree_group_token(self) -> str:
        """Group rank 0's fresh token, broadcast on the side group (collective)."""
        token = uuid.uuid4().hex[:16]
        if not self.distributed or self.world_size < 2:
            return token
        box: list[Any] = [token if self.group_rank == 0 else None]
        dist.broadcast_object_list(box, group_src=0, group=self.group)
        return str(box[0])

    # -- saving ---------------------------------------------------------------------------
    def path_for(self, step: int) -> Path:
        return step_dir(self.root, self.guard.job, step)

    def save(self, step: int, model: Any, optimizer: Any, extra: Mapping[str, Any] | None = None,
             *, blocking: bool = False) -> None:
        """Save model, optimizer, ``step``, this rank's RNG states and ``extra``.

        Asynchronous unless ``blocking`` (or ``use_async=False``): returns after the staging
        copy; the write, the checksums and the report follow on a background thread. A
        second save first waits for the previous one (the side group runs one save at a
        time). Saving the step saved last is a no-op, so a ``save_now`` and the periodic
        save of the same step do not write it twice. Failures never raise into training:
        they become a report with ``ok=False`` that names the error. With ``incremental``,
        the ranks first agree whether this save is full or an increment (collective).
        """
        self._model, self._optimizer = model, optimizer
        if step == self._last_step:
            return
        if self.guard.regrouping:
            log.info("step %d not saved: a peer was lost and the group re-forms", step)
            return
        self.wait()
        self._last_step = step
        t0 = time.perf_counter()
        path = self.path_for(step)
        if self._broken:
            self._publish(self._report(step, path, {}, 0.0, 0.0,
                                       f"checkpoint group unusable since an earlier failure "
                                       f"({self._broken}); restart the job to recover"))
            return
        try:
            state = self._state(step, model, optimizer, extra)
        except Exception as exc:  # before any collective: the side group is still in step
            self._publish(self._report(step, path, {}, time.perf_counter() - t0,
                                       time.perf_counter() - t0, _describe(exc)))
            return
        base: int | None = None
        try:
            from torch.distributed.checkpoint.filesystem import FileSystemWriter
            from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
            from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

            if self.chain.every:
                state, increment = self._plan(step, state)
                base = increment.base if increment is not None else None
            else:
                increment = None
            writer = FileSystemWriter(str(path))
            if blocking or not self.use_async:
                metadata = dcp_save(state, storage_writer=writer, process_group=self.group,
                                    no_dist=not self.distributed)
                done: Future[Any] = Future()
                done.set_result(metadata)
                finished: Future[CheckpointReport] = Future()
                finished.set_result(self._finish(step, path, done, t0, blocking=True,
                                                 increment=increment))
                self._pending = finished
                return
            pending = dcp_async_save(state, storage_writer=writer, process_group=self.group,
                                     no_dist=not self.distributed, async_stager=self._stager_())
            upload: Future[Any] = pending if isinstance(pending, Future) \
                else pending.upload_completion
        except _save_errors() as exc:
            self.chain.saved(False)
            self._fail(exc)
            self._publish(self._report(step, path, {}, time.perf_counter() - t0,
                                       time.perf_counter() - t0, _describe(exc), base=base))
            return
        blocked = time.perf_counter() - t0
        # The rank and group as they are now: an in-place re-form may renumber this rank
        # before the save is done.
        self._pending = self._finisher.submit(self._finish, step, path, upload, t0,
                                              blocking=False, blocked=blocked,
                                              as_of=self._as_of(), increment=increment)

    def _plan(self, step: int, state: dict[str, Any]) -> tuple[dict[str, Any], Increment | None]:
        """Full or incremental (collective: the ranks agree, :func:`.increments.decide`):
        the state to write, and the increment record where tensors are left to the base."""
        now = digests(state)
        views: list[RankView] = self._gather(self.chain.view(now))
        decision = decide(views, self.chain.every, now.keys())
        self.chain.saving(step, decision, now)
        if decision.base is None:
            if self.chain.base is not None:
                log.debug("step %d saved in full: %s", step, decision.why_full)
            return state, None
        return without(state, decision.held.keys()), \
            Increment(base=decision.base, held=decision.held)

    def commit(self, step: int, *, format: str,
               path: str | os.PathLike[str] | None = None) -> None:
        """Report a checkpoint a framework wrote itself (Lightning's, the Hugging Face
        Trainer's, torchtitan's), so the coordinator verifies and commits it as it does the
        Checkpointer's own, and resumes and rollbacks find it.

        Collective, once every rank's part of the save returned. The ranks meet on the side
        group, so every file is on disk; then group rank 0 reports each file directly in
        ``path`` (default :meth:`path_for`) with its checksum, on the background thread,
        and the others report none: which rank wrote which file is the framework's
        business. ``format`` names the framework (the coordinator requires DCP's
        ``.metadata`` only of ``dcp``)."""
        if step == self._last_step:
            return
        self.wait()
        self._last_step = step
        t0 = time.perf_counter()
        where = Path(path) if path is not None else self.path_for(step)
        as_of = self._as_of()
        try:
            if self.distributed and self.world_size > 1:
                dist.barrier(group=self.group)
        except Exception as exc:  # a peer lost mid-save: the group restarts anyway
            self._fail(exc)
            self._publish(self._report(step, where, {}, time.perf_counter() - t0,
                                       time.perf_counter() - t0, _describe(exc), as_of=as_of,
                                       format=format))
            return
        self._pending = self._finisher.submit(self._finish_files, step, where, t0, as_of,
                                              format)

    def _finish_files(self, step: int, path: Path, t0: float, as_of: _SaveContext,
                      format: str) -> CheckpointReport:
        """Background thread of :meth:`commit`: digest and report a framework's files."""
        files: dict[str, FileDigest] = {}
        error = ""
        if as_of.group_rank == 0:
            try:
                entries = sorted(path.iterdir())
                if not entries:
                    raise FileNotFoundError(f"{path} holds no files")
                nested = [e.name for e in entries if e.is_dir()]
                if nested:
                    raise ValueError(f"{path} holds directories ({', '.join(nested[:3])}): "
                                     "only files directly in a checkpoint are verified")
                for entry in entries:
                    files[entry.name] = file_digest(entry)
                if (written := self._write_run_record(path)):
                    files[written.name] = file_digest(written)
            except (OSError, ValueError) as exc:
                error = _describe(exc)
        total = time.perf_counter() - t0
        report = self._report(step, path, files, 0.0, total, error, as_of=as_of, format=format)
        self._publish(report)
        return report

    def _stager_(self) -> DefaultStager | None:
        """The staging cache, made at the first async save (it imports all of DCP, which
        must not happen before the first step)."""
        if self._stager is None and self._cache_staging:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            # Reused across saves: its cached CPU storages are overwritten by the next
            # staging, which is safe because a save starts only after the previous one ended.
            self._stager = DefaultStager(StagingOptions(
                use_pinned_memory=torch.cuda.is_available(), use_shared_memory=False,
                use_async_staging=False, use_non_blocking_copy=False))
        return self._stager

    def wait(self, timeout: float | None = None) -> CheckpointReport | None:
        """Wait for the last save (if not waited for yet) and return its report."""
        pending = self._pending
        if pending is None:
            return None
        report = pending.result(timeout)
        self._pending = None
        return report

    def close(self) -> None:
        """Finish the save in flight (``guard.close()`` calls this first; call it yourself
        before ``destroy_process_group()``). Safe to call twice."""
        try:
            self.wait()
        finally:
            self._finisher.shutdown(wait=True)
            if self.memory is not None:
                self.memory.close()
            if self.buddies is not None:
                self.buddies.close()
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    def _state(self, step: int, model: Any, optimizer: Any,
               extra: Mapping[str, Any] | None) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)
        me = f"rank{self.group_rank}"
        state: dict[str, Any] = {
            "model": model_sd,
            "optim": optim_sd,
            STEP_KEY: {"step": step},
            "rng": {me: _rng_state()},
        }
        if extra is not None:
            blob = to_blob(dict(extra))
            from_blob(blob)  # refused now, in the report, rather than at the next resume
            state["extra"] = {me: blob}
        if self.data is not None:
            state["data"] = {me: self.data.encoded()}
        return state

    def _as_of(self) -> _SaveContext:
        """What a save is reported under, taken at its start."""
        return _SaveContext(self.guard.rank, self.group_rank, self.world_size, self.group_token,
                            self.state_since, self._topology())

    def _topology(self) -> Topology | None:
        """The layout of the model being saved (read once per model: its placements do not
        change while it trains)."""
        model = self._model
        if model is None:
            return None
        if self._layout is None or self._layout[0] is not model:
            try:
                self._layout = (model, state_layout(model).topology)
            except Exception as exc:  # a layout nobody can read must not cost the save
                log.debug("state layout unreadable: %r", exc)
                self._layout = (model, None)
        return self._layout[1]

    def _finish(self, step: int, path: Path, upload: Future[Any], t0: float, *,
                blocking: bool, blocked: float = 0.0, as_of: _SaveContext | None = None,
                increment: Increment | None = None) -> CheckpointReport:
        """Runs on the background thread (inline for a blocking save): wait for DCP, checksum
        this rank's files, report (under ``as_of``, the save's start: see :meth:`_as_of`).
        Group rank 0 writes an increment's ``INCREMENT`` and reports it with its files."""
        as_of = as_of or self._as_of()
        files: dict[str, FileDigest] = {}
        error = ""
        try:
            metadata = upload.result()
            names = _written_names(metadata, path)
            for name in rank_files(names, as_of.group_rank):
                files[name] = file_digest(path / name)
            if as_of.group_rank == 0 and increment is not None:
                files[INCREMENT_FILE] = file_digest(
                    write_atomically(path / INCREMENT_FILE, encode_increment(increment)))
            if as_of.group_rank == 0 and (written := self._write_run_record(path)):
                files[written.name] = file_digest(written)  # committed and verified too
        except _save_errors() as exc:
            self._fail(exc)
            error = _describe(exc)
        self.chain.saved(not error)
        total = time.perf_counter() - t0
        report = self._report(step, path, files, total if blocking else blocked, total, error,
                              as_of=as_of, base=increment.base if increment else None)
        self._publish(report)
        return report

    def _write_run_record(self, path: Path) -> Path | None:
        """``run.json`` in the checkpoint directory (None where it could not be written:
        the checkpoint stands without it). Group rank 0 reports it with its files, so the
        coordinator commits and verifies it with the rest."""
        from trainguard.runs import collect_run_record, write_run_record  # 25 ms: not at start

        try:
            if self.run_record is None:
                self.run_record = collect_run_record(
                    job=self.guard.job, seed=getattr(self.guard, "seed", None),
                    manifest=self.manifest, config=self.run_config)
            return write_run_record(path, self.run_record)
        except (OSError, TrainguardError) as exc:
            log.warning("run record not written to %s: %s", path, exc)
            return None

    def _fail(self, exc: BaseException) -> None:
        """A collective that timed out or lost a peer leaves the side group out of step with
        the other ranks: a later save on it could pair with the wrong operation, so later
        saves are refused until a restart. DCP's own ``CheckpointException`` (a rank failed
        to write, and every rank learned it through completed collectives) leaves the group
        usable."""
        from torch.distributed.checkpoint.api import CheckpointException

        if self.distributed and not isinstance(exc, CheckpointException):
            self._broken = _describe(exc)[:300]
        log.warning("checkpoint save failed: %s", _describe(exc))

    def _report(self, step: int, path: Path, files: dict[str, FileDigest], blocked: float,
                total: float, error: str, as_of: _SaveContext | None = None,
                format: str = "dcp", base: int | None = None) -> CheckpointReport:
        g = self.guard
        as_of = as_of or self._as_of()
        return CheckpointReport(
            id=uuid7(), job=g.job, rank=as_of.rank, step=step, path=str(path),
            world_size=as_of.world_size, bytes=sum(d.bytes for d in files.values()),
            seconds_blocked=blocked, seconds_total=total, files=files,
            attempt=g.identity.attempt.restart_count, group_token=as_of.group_token,
            ok=not error, error=error[:2000], time=time.time(), state_since=as_of.state_since,
            topology=as_of.topology, format=format, base=base)

    def _publish(self, report: CheckpointReport) -> None:
        with self._lock:
            self.reports.append(report)
        self.guard.publish_checkpoint_report(report)

    # -- loading --------------------------------------------------------------------------
    def resume(self, model: Any, optimizer: Any, *,
               timeout: float = RESUME_TIMEOUT) -> int:
        """Load the newest committed checkpoint that loads; returns the first step to run.

        Collective. The newest committed checkpoint comes first; one that cannot be loaded
        (a file gone, a digest that no longer matches, a layout DCP cannot reshard) is
        skipped for the newest committed one below it, and the job is told (a ``resume``
        recovery report the incident carries). 0 when the job has no committed checkpoint,
        or for a replacement joining in place (its state comes from its peers). Committed
        checkpoints that all fail to load raise :class:`NoCheckpointLoads`: a start from
        step 0 is a failure, never a recovery.
        """
        ready = time.time()
        self.check_data()
        point = self.resume_point(timeout)
        newest = point.step if point is not None else None
        failures: list[str] = []
        while point is not None:
            try:
                step = self.load(point, model, optimizer)
            except _save_errors() as exc:
                why = _describe(exc)
                log.error("checkpoint at step %d (%s) does not load: %s", point.step,
                          point.path, why)
                failures.append(f"step {point.step}: {why}")
                point = self.resume_point(timeout, below_step=point.step)
                continue
            self._report_resume(point, newest, failures, ready, time.time())
            return step + 1
        if failures:
            raise NoCheckpointLoads(
                f"no committed checkpoint of job {self.guard.job} loads ("
                f"{'; '.join(failures)}): refusing to start from step 0; restore the files "
                "or roll back explicitly (trainguard rollback)")
        return 0

    def check_data(self) -> None:
        """Every rank checks its copy of the data against ``manifest`` (collective); with
        ``refuse`` all raise if any rank's differs (:class:`~trainguard.runs.DataRefused`)."""
        if self.manifest is None:
            return
        from trainguard.runs import DataRefused, check_data

        found: BaseException | None = None
        try:
            check_data(self.manifest, policy=self.data_policy)
        except DataRefused as exc:
            found = exc
        self._agree_loadable(found, refusal=DataRefused, what="has other data than the "
                             "manifest says")

    def resumed(self, point: ResumePoint, *, ready: float, loaded: float) -> None:
        """A framework loaded ``point`` itself (its own format): tell the incident where the
        restarted job came back and where the time went, as :meth:`resume` does. ``ready``:
        when the rank asked for the point; ``loaded``: when the state was in place."""
        self._report_resume(point, point.step, [], ready, loaded)

    def _report_resume(self, point: ResumePoint, newest: int | None, failures: list[str],
                       ready: float, loaded: float) -> None:
        """Group rank 0 tells the incident where the restarted job came back, what it
        could not load and where the time went (:mod:`trainguard.contract.timeline`: its
        agent's stamps, then its own), once its first step ended."""
        if self.group_rank != 0:
            return
        saved = point.topology.describe() if point.topology is not None else "layout unknown"
        reason = f"loaded step {point.step} ({saved}) at world size {self.world_size}"
        if failures:
            reason = f"{reason}, not the newer {'; '.join(failures)}"
        stamps = timeline.decode_stamps(os.environ.get(envnames.RESTART_STAMPS))
        if stamps is not None and stamps.ranks:
            reason = f"{reason}; {stamps.warm} of {stamps.ranks} rank(s) on its host warm"
        attempt = self.guard.identity.attempt

        def publish(first_step: float | None) -> None:
            phases = timeline.restart_phases(stamps, ready=ready, loaded=loaded,
                                             first_step=first_step or loaded)
            if first_step is None:
                phases.pop("first_step")  # the job ended (or broke) before a step did
            self.guard.publish_recovery(recovery_report(
                self.guard, kind="resume", path="restart", reason=reason[:2000],
                generation=attempt.generation, previous_generation=attempt.generation,
                world_size=self.world_size, resumed_step=point.step + 1,
                steps_lost=max(0, (newest or point.step) - point.step),
                seconds=round(sum(phases.values()), 4), phases=phases))

        self.guard.after_step(publish)

    def resume_point(self, timeout: float = RESUME_TIMEOUT, *,
                     below_step: int | None = None) -> ResumePoint | None:
        """``guard.resume_point()`` asked once, on group rank 0, and shared with every rank.

        Collective. Ranks asking on their own could straddle a commit and load different
        steps; this way they load the same one. A replacement rank (``TRAINGUARD_JOIN=peers``)
        gets None without asking: its state comes from its peers. ``below_step``: the
        newest committed checkpoint below that step instead.
        """
        if self.guard.joining:
            return None
        point = self.guard.resume_point(timeout=timeout, below_step=below_step) \
            if self.group_rank == 0 else None
        if not self.distributed or self.world_size < 2:
            return point
        box: list[Any] = [encode_durable(point) if point is not None else None]
        dist.broadcast_object_list(box, group_src=0, group=self.group)
        return decode_durable(box[0], ResumePoint) if box[0] is not None else None

    def load(self, point: ResumePoint | str | os.PathLike[str], model: Any, optimizer: Any) -> int:
        """Restore model, optimizer, RNG states and ``extra`` from a checkpoint; returns its
        step. Collective: every rank calls it with the same point.

        Sharded state (FSDP2, tensor parallel, HSDP) loads at any world size or mesh: DCP
        reshards it from the saved layout. The RNG states of a rank that was not part of
        the saving world are left as they are, with a warning. A checkpoint one rank
        refuses is refused by all, before any of them reads (the ranks agree first), so a
        failure leaves every rank able to try an older one. Where the coordinator committed
        it, every file the load reads (an increment's base's too) must match the commit
        record's size and CRC32 first; the ranks share that reading.
        """
        self._model, self._optimizer = model, optimizer
        self.wait()
        started = time.time()  # as early as load knows of the point: errs old, not new
        from_bus = isinstance(point, ResumePoint)
        found: BaseException | None = None
        try:
            path = confine(point.path if isinstance(point, ResumePoint) else point, self.root,
                           self.guard.job)
            chain = open_chain(path, self.root, self.guard.job, required=from_bus)
            for link in chain:  # each rank checks its share of the files the load reads
                verify_files(link, self.group_rank, self.world_size)
        except Exception as exc:
            found = exc
        self._agree_loadable(found)
        self.chain.forget()  # the state comes from elsewhere: the next save starts a chain
        metadata = chain[0].metadata
        held = set(chain[0].increment.held) if chain[0].increment is not None else set()
        keys = set(metadata.state_dict_metadata)
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        model_sd, optim_sd = get_state_dict(model, optimizer)
        me = f"rank{self.group_rank}"
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd, STEP_KEY: {"step": -1}}
        if f"rng.{me}.torch" in keys:
            template = _rng_state()
            state["rng"] = {me: {k: template[k] for k in template if f"rng.{me}.{k}" in keys}}
        else:
            log.warning("checkpoint %s has no RNG state for %s; RNG streams not restored",
                        path, me)
        if f"extra.{me}" in keys:
            state["extra"] = {me: b""}
        if self.data is not None and f"data.{me}" in keys:
            state["data"] = {me: b""}
        elif self.data is not None:
            log.warning("checkpoint %s holds no data position for %s: the data stream "
                        "starts from its beginning", path, me)
        left = _saved_ranks(keys) - set(range(self.world_size))
        if left and self.group_rank == 0:
            log.warning("checkpoint %s was saved by %d more ranks than load it: the RNG "
                        "streams and extra of ranks %s are not restored anywhere", path,
                        len(left), sorted(left)[:8])
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            # An increment's own tensors and values first, then what it left to its base
            # (tensors only, loaded in place).
            from_base = only(state, held)
            state = without(state, held)
            parts = [(chain[0], state)] + ([(chain[1], from_base)] if held else [])
            for link, part in parts:
                dcp_load(part, storage_reader=reader_for(link.path, link.metadata),
                         planner=safe_load_planner(), process_group=self.group,
                         no_dist=not self.distributed)
            graft(state, from_base)
        except CheckpointException as exc:  # DCP wraps what a rank raised: say it plainly
            refused = [f[0] for f in exc.failures.values() if isinstance(f[0], CheckpointRefused)]
            if refused:
                raise refused[0] from None
            raise
        # What may still be refused comes first: a refusal leaves the model untouched.
        extra = position = None
        try:
            extra = from_blob(state["extra"][me]) if "extra" in state else None
            position = from_blob(state["data"][me]) if "data" in state else None
        except Exception as exc:
            found = exc
        self._agree_loadable(found)
        if "rng" in state and not _set_rng_state(state["rng"][me]):
            log.warning("checkpoint %s holds a pickled RNG state (an older trainguard): not "
                        "unpickled; the RNG streams stay as they are", path)
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        if position is not None and self.data is not None:
            self.data.restore(position)
        self.loaded_extra = extra
        self.state_since = started
        step = int(state[STEP_KEY]["step"])
        self._last_step = step
        return step

    def _agree_loadable(self, found: BaseException | None, *,
                        refusal: type[TrainguardError] = CheckpointRefused,
                        what: str = "cannot load this checkpoint") -> None:
        """Every rank raises if any rank found the checkpoint unloadable (its own error, or
        the first failing rank's as ``refusal``); else returns on all."""
        if not self.distributed or self.world_size < 2:
            if found is not None:
                raise found
            return
        verdicts: list[Any] = [None] * self.world_size
        dist.all_gather_object(verdicts, _describe(found) if found is not None else "",
                               group=self.group)
        if found is not None:
            raise found
        for rank, why in enumerate(verdicts):
            if why:
                raise refusal(f"rank {rank} {what}: {why}")

    # -- the coordinator's save_now -------------------------------------------------------
    def _on_save_now(self, cmd: Command) -> str:
        """Runs at a safe point, at the same step on every rank. The ack's detail carries
        ``step=<S>``, which is how the coordinator learns the step of a ``seq`` command."""
        step = cmd.at_step if cmd.at_step is not None else self._completed_step()
        if step is None:
            raise RuntimeError("no step has completed yet: nothing to save")
        if self.saver is not None:
            if step == self._last_step:
                return f"step={step} already saved"
            return f"step={self.saver(step)} saving"
        model = self.guard.model if self.guard.model is not None else self._model
        optimizer = self.guard.optimizer if self.guard.optimizer is not None else self._optimizer
        if model is None:
            raise RuntimeError("nothing to save: call guard.attach(model, optimizer) or "
                               "Checkpointer.save() first")
        if step == self._last_step:
            return f"step={step} already saved"
        extra = self.extra_fn() if self.extra_fn is not None else None
        self.save(step, model, optimizer, extra, blocking=bool(cmd.params.get("blocking")))
        return f"step={step} saving to {self.path_for(step)}"

    def _on_reload(self, cmd: Command) -> str:
        """``reload``: roll back in place to committed checkpoint ``params.step`` (at the same
        step on every rank), or to the memory snapshot every rank holds below
        ``params.below`` where it is as new; with ``step`` :data:`MEMORY_ONLY` (nothing on
        disk yet) to that snapshot alone. ``guard.steps`` continues after it."""
        step = int(cmd.params["step"])
        below = cmd.params.get("below")
        if step == MEMORY_ONLY and below is None:
            raise ValueError("a reload from memory only needs params.below (the onset)")
        path = str(cmd.params.get("path") or self.path_for(step))
        model = self.guard.model if self.guard.model is not None else self._model
        optimizer = self.guard.optimizer if self.guard.optimizer is not None else self._optimizer
        if model is None:
            raise RuntimeError("nothing to reload into: call guard.attach(model, optimizer)")
        last = self.guard.last_completed_step
        t0 = time.perf_counter()
        self.guard.rewind(step + 1)  # raises first when the loop is not guard.steps
        snapshot, why_not = (None, "") if below is None else \
            self._agree_snapshot(int(below), step, model, optimizer)
        try:
            if snapshot is not None:
                loaded, source, tier = self._restore_snapshot(snapshot, model, optimizer), \
                    "memory", "memory"
            elif step == MEMORY_ONLY:
                raise RuntimeError(f"no checkpoint on disk to go back to, and {why_not}")
            else:
                loaded, source, tier = self.load(path, model, optimizer), path, "disk"
        except BaseException:
            self.guard.rewind((last if last is not None else step) + 1)
            raise
        if self.memory is not None:
            self.memory.restored(loaded)
        if loaded != step:
            self.guard.rewind(loaded + 1)
        seconds = time.perf_counter() - t0
        recovery = self.guard.recovery
        if self.group_rank == 0:
            generation = recovery.generation if recovery is not None else \
                self.guard.identity.attempt.generation
            reason = str(cmd.params.get("reason") or "reload")
            reason += f"; from memory: the snapshot of step {loaded}" if tier == "memory" \
                else (f"; from disk: {why_not}" if why_not else "")
            self.guard.publish_recovery(recovery_report(
                self.guard, kind="rollback", path="in_place", reason=reason, tier=tier,
                generation=generation, previous_generation=generation,
                world_size=self.world_size, last_completed=last, resumed_step=loaded + 1,
                steps_lost=max(0, (last if last is not None else loaded) - loaded),
                seconds=seconds))
        return f"step={loaded} reloaded in place from {source}"

    def _agree_snapshot(self, below: int, disk_step: int, model: Any, optimizer: Any
                        ) -> tuple[int | None, str]:
        """The memory snapshot every rank restores instead of disk checkpoint
        ``disk_step``: the newest step below ``below`` (the onset) that every rank holds
        and verified, when it is not older than the disk's (collective). None, and why,
        when there is none: the disk is the next tier."""
        # A save in flight runs DCP's collectives on the side group from its thread: ours
        # must not interleave with them.
        self.wait()
        mine = self.memory.held(below) if self.memory is not None else []
        held = self._gather(mine)
        common = set.intersection(*(set(h) for h in held)) if held else set()
        if not common:
            lacking = [r for r, h in enumerate(held) if not h]
            return None, (f"no memory snapshot below step {below} on every rank"
                          + (f" (none on rank(s) {lacking[:8]})" if lacking else ""))
        chosen = max(common)
        if chosen < disk_step:
            return None, f"the newest memory snapshot (step {chosen}) is older than the disk's"
        why = self.memory.verify(chosen, model, optimizer) if self.memory is not None \
            else "no memory snapshots"
        verdicts = self._gather(why)
        bad = [(r, v) for r, v in enumerate(verdicts) if v]
        if bad:
            rank, reason = bad[0]
            log.warning("memory snapshot of step %d not used: rank %d: %s", chosen, rank, reason)
            return None, f"rank {rank}'s memory snapshot of step {chosen} was refused: {reason}"
        return chosen, ""

    def _restore_snapshot(self, step: int, model: Any, optimizer: Any) -> int:
        assert self.memory is not None
        started = time.time()
        self.loaded_extra = self.memory.restore(step, model, optimizer)
        self.chain.forget()
        self.state_since = started
        self._last_step = step  # a later save of a step past it is the replayed one's
        return step

    def restore_shards(self, completed: int, joined: bool) -> tuple[int, str, str]:
        """After an in-place re-form of a state sharded with no replica (collective on the
        side group, :class:`~trainguard.recovery.loop.ShardKeeper`): a replacement takes
        the copies of its shard from the rank holding them; then every rank restores the
        newest snapshot at or below ``completed`` that every rank holds and verifies
        (:meth:`_agree_snapshot`, the rollback's), else the committed checkpoint."""
        model = self.guard.model if self.guard.model is not None else self._model
        optimizer = self.guard.optimizer if self.guard.optimizer is not None else self._optimizer
        assert self.memory is not None and self.buddies is not None
        self.wait()
        held = self._gather((self.guard.rank, self.buddies.held()))
        if joined:
            self._take_copies(held)
            for step in self.memory.held(completed + 1):
                self.memory.prime(step, optimizer)
        point = self._gather(self.guard.resume_point(str(self.root)))[0]
        chosen, why_not = self._agree_snapshot(completed + 1, point.step if point else -1,
                                               model, optimizer)
        if chosen is not None:
            loaded, tier = self._restore_snapshot(chosen, model, optimizer), "memory"
        elif point is not None:
            log.warning("shards from the committed checkpoint of step %d: %s", point.step,
                        why_not)
            loaded, tier = self.load(point, model, optimizer), "disk"
        else:
            raise RuntimeError(f"no committed checkpoint and {why_not}")
        self.memory.restored(loaded)
        self.buddies.restored(loaded)
        return loaded, tier, why_not

    def _take_copies(self, held: list[tuple[int, dict[int, list[int]]]]) -> None:
        """A replacement: the copies of its shard, from the rank that holds them, as its own
        snapshots (verified again before use)."""
        assert self.memory is not None and self.buddies is not None
        me = self.guard.rank
        for holder, copies in held:
            for step in copies.get(me, []):
                try:
                    copy = self.buddies.fetch(self.buddies.peers[holder], me, step)
                except (OSError, ValueError) as exc:
                    log.warning("rank %d's copy of step %d not fetched: %s", holder, step, exc)
                    continue
                if copy is not None:
                    self.memory.adopt(copy.snapshot(f"rank {holder}'s copy"))

    def _pair_buddies(self) -> None:
        """Collective on the side group: every rank's listener, host and domain; the key
        is group rank 0's."""
        assert self.buddies is not None
        box = self._gather((self.guard.rank, self.buddies.address, self.guard.identity.host,
                            self.failure_domain, Buddies.new_key()))
        self.buddies.pair(box[0][4], [b[0] for b in box], [b[1] for b in box],
                          [b[2] for b in box], [b[3] for b in box])

    def _gather(self, mine: Any) -> list[Any]:
        """Every rank's ``mine`` on the side group, by group rank."""
        if not self.distributed or self.world_size < 2:
            return [mine]
        box: list[Any] = [None] * self.world_size
        dist.all_gather_object(box, mine, group=self.group)
        return box

    def _snapshot_checked(self, snap: Snapshot) -> None:
        """On the snapshots' check thread: tell the control plane (throttled by the Guard)."""
        mem, guard = self.memory, self.guard
        if mem is None:
            return
        self._snapshot_seq += 1
        kept = mem.clean()
        buddies = self.buddies
        if buddies is not None:
            buddies.send(snap)
        guard.publish_snapshot(SnapshotReport(
            job=guard.job, time=time.time(), seq=self._snapshot_seq, rank=guard.rank,
            step=snap.step, attempt=guard.identity.attempt.restart_count, taken=snap.taken,
            bytes=snap.nbytes, copy_seconds=snap.copy_seconds, check_seconds=snap.check_seconds,
            every=mem.interval, kept_steps=[s.step for s in kept],
            oldest_taken=kept[0].taken if kept else snap.taken, host_bytes=mem.nbytes,
            world_size=guard.world_size,
            buddy=-1 if buddies is None or buddies.target_rank is None
            else buddies.target_rank,
            buddy_sent=list(buddies.sent) if buddies else [],
            buddy_held=buddies.held() if buddies else {},
            buddy_bytes=buddies.nbytes if buddies else 0))

    def _snapshot(self, step: int) -> None:
        """After each completed step of ``guard.steps``: a memory snapshot when due."""
        model = self.guard.model if self.guard.model is not None else self._model
        optimizer = self.guard.optimizer if self.guard.optimizer is not None else self._optimizer
        if self.memory is None or model is None or step == self.guard.abandoned:
            return
        if self.guard.nonfinite_at is not None:
            return  # the state after a non-finite step is suspect: keep the clean ones
        every = self.guard.fingerprint_every
        self.memory.step_done(step, model, optimizer, self.extra_fn,
                              anchor=every > 0 and step % every == 0)

    def _completed_step(self) -> int | None:
        # The Guard has no public accessor for the last completed step yet.
        return self.guard.last_completed_step


def _buddy_address(host: str) -> str:
    """Where this rank's buddy listener binds: ``TRAINGUARD_SNAPSHOT_BUDDY_ADDR``, else the
    local address that routes to the rendezvous (``MASTER_ADDR``: the interface the job's
    ranks reach each other on), else the address ``host`` resolves to."""
    raw = os.environ.get(envnames.SNAPSHOT_BUDDY_ADDR, "").strip()
    if raw:
        return raw
    master = os.environ.get("MASTER_ADDR", "").strip()
    if master:
        with contextlib.suppress(OSError), \
                socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master, 9))  # UDP: no packet is sent, the route is chosen
            return str(probe.getsockname()[0])
    try:
        return socket.gethostbyname(host)
    except OSError:
        raise ConfigError(f"{envnames.SNAPSHOT_BUDDY_ADDR} is unset and neither MASTER_ADDR "
                          f"nor host {host!r} resolves: set it to the address the other "
                          "hosts reach this one at") from None


def _env_incremental() -> int:
    raw = os.environ.get(envnames.CHECKPOINT_INCREMENTAL, "").strip()
    try:
        return int(raw) if raw else 0
    except ValueError:
        raise ConfigError(f"{envnames.CHECKPOINT_INCREMENTAL}={raw!r}: set it to the number of "
                          "incremental saves between full ones (0: every save is full)") from None


def _saved_ranks(keys: set[str]) -> set[int]:
    """The group ranks whose RNG state a checkpoint holds (``rng.rank<r>.torch``)."""
    found = set()
    for key in keys:
        head, _, rest = key.partition(".")
        name = rest.split(".", 1)[0]
        if head == "rng" and name.startswith("rank") and name[4:].isdigit():
            found.add(int(name[4:]))
    return found


def _written_names(metadata: Any, path: Path) -> set[str]:
    """File names of this save: from DCP's metadata where it has them, else the directory."""
    from torch.distributed.checkpoint.metadata import Metadata

    if isinstance(metadata, Metadata) and isinstance(metadata.storage_data, dict):
        names = {getattr(info, "relative_path", "") for info in metadata.storage_data.values()}
        names.discard("")
        if names:
            return names
    return set(os.listdir(path))


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:2000]
