"""What an anomaly carries as evidence: one Struct per anomaly kind.

The detector writes these and the diagnoser (and anyone on the event subjects) reads them;
the JSON names are the keys the detector has always written, so the wire did not change.

Why ``Anomaly.evidence`` is typed this way and not as a msgspec tagged union: a tagged
union needs its tag *inside* the evidence object, but the kind travels beside it
(``Anomaly.kind``), and anomalies already on the streams and in Redis have no tag there
(they would fail to decode). msgspec cannot pick a nested Struct by a field of its parent,
so the field is declared ``Any`` for msgspec (:data:`EvidenceField`) and
``Anomaly.__post_init__`` turns the decoded object into the kind's Struct with
:func:`typed_evidence`. For the type checker the field is the :data:`Evidence` union;
``match anomaly.evidence: case HangEvidence(): ...`` narrows it.

Every field has a default and no Struct forbids unknown fields, so an anomaly from a newer
detector (a new key) or an older one (a key missing) still decodes; a value of the wrong
type is a validation error (dead letter), like anywhere else on the wire. Fields the
detector leaves out on some paths (resolution details, limits a process-state hang has
none of) default to None. Free-form vocabularies inside evidence (``source``,
``culprit_basis``, process state letters) are plain strings: a reader must never reject an
anomaly over a word it does not know yet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Final, Literal, TypeAlias, cast

import msgspec


# -- what flight-recorder dumps say (read by trainguard.analysis.flightrec) -------------
class GroupStatus(msgspec.Struct, kw_only=True):
    """One process group as one rank saw it."""

    name: str
    desc: str = ""
    ranks: list[int] = []
    """Members from ``pg_config`` (empty where the dump does not say: gloo)."""
    enqueued: int = 0
    completed: int = 0
    p2p: bool = False
    """The rank's recorded ops in this group are point-to-point: counters not comparable."""
    frontier: str = ""
    """The op name of the first collective not completed (``nccl:all_reduce``), if recorded."""


class RankRecord(msgspec.Struct, kw_only=True):
    """What one rank's dump says, reduced to what the analysis needs."""

    rank: int
    source: str = ""
    version: str = ""
    entries: int = 0
    groups: dict[str, GroupStatus] = {}
    error: str = ""
    """Why the dump could not be read (the record then says nothing else)."""


class GroupFinding(msgspec.Struct, kw_only=True):
    group: str
    desc: str = ""
    ranks: list[int] = []
    behind: list[int] = []
    """Members others in this group wait for."""
    why: dict[str, str] = {}
    """Per behind rank (as a string key): what it is behind on."""
    missing: list[int] = []
    mismatched: list[int] = []
    """Ranks whose next collective differs from the group's (minority op name)."""


class Analysis(msgspec.Struct, kw_only=True):
    culprits: list[int] = []
    groups: list[GroupFinding] = []
    """Groups with a finding, culprits' groups first."""
    ranks: list[int] = []
    """Ranks whose dumps were read."""
    missing: list[int] = []
    empty: list[int] = []
    """Dumps with no entries while others have some."""
    unreadable: dict[str, str] = {}
    skipped_p2p: list[str] = []

    def culprit_groups(self) -> list[str]:
        chosen = set(self.culprits)
        return [g.group for g in self.groups if chosen & set(g.behind)]



# -- evidence by anomaly kind ---------------------------------------------------------
class _Evidence(msgspec.Struct, kw_only=True):
    KIND: ClassVar[str] = ""


# -- liveness --------------------------------------------------------------------------


class CrashEvidence(_Evidence, kw_only=True):
    """A worker that died: from its ``WorkerExit`` or the agent's process state."""

    KIND: ClassVar[str] = "crash"
    source: str = ""
    """``worker_exit`` (an exit report) or ``node_heartbeat`` (a zombie for hb_timeout)."""
    exit_id: str = ""
    exit_code: int | None = None
    signal: str | None = None
    error: str = ""
    stderr_tail: str = ""
    pid: int | None = None
    local_rank: int | None = None
    attempt: int = 0
    confirmed_gone: bool = False
    """No exit code and no signal: the agent confirms the process is gone."""
    process_state: str | None = None
    """The agent's letter (``Z``/``X``) when the crash comes from its node heartbeat."""
    last_step: int | None = None
    phase: str | None = None
    restarted_attempt: int | None = None
    """Set on resolution: the attempt the rank came back in."""


class UnresponsiveEvidence(_Evidence, kw_only=True):
    """Silent ranks of one host, keyed by rank (as a string: JSON object keys)."""

    KIND: ClassVar[str] = "unresponsive"
    hb_timeout: float = 0.0
    last_heard: dict[str, float] = {}
    silent_for: dict[str, float] = {}
    last_step: dict[str, int | None] = {}


class RankPhase(msgspec.Struct, kw_only=True):
    """Where one rank was when a hang was declared."""

    phase: str = "idle"
    elapsed: float | None = None
    host: str = ""
    step: int | None = None
    coll_seq: int = 0
    state: str = "alive"
    """``alive``, ``silent`` or ``stopped``."""
    process_state: str | None = None
    quiet_for: float | None = None
    """How long its phase had shown no work (no CPU, no I/O) when last heard; None: it
    was working, or it is not known."""


class HangEvidence(_Evidence, kw_only=True):
    """No progress: who holds the job up, on what basis, and the limit that was passed."""

    KIND: ClassVar[str] = "hang"
    culprits: list[int] = []
    culprit_basis: str = ""
    """``process_state``, ``phase``, ``silent``, ``coll_seq`` or ``none``."""
    stalled_since: float | None = None
    stalled_for: float | None = None
    limit: float | None = None
    limit_basis: str = ""
    """``startup_grace``, ``hang_floor`` (the job showed a wait), ``unclear_hang_floor``
    (it did not), ``p99`` or ``phase:<name>``."""
    p99_step_interval: float | None = None
    hang_floor: float | None = None
    """The floor that applied (``hang_floor`` or ``unclear_hang_floor``)."""
    unclear: str = ""
    """Why the job did not show what it waits for ("" when it did): too few steps
    learned, ranks unheard since the stall, too few in a collective, the holder in an
    irregular phase or on its first step."""
    hang_k: float | None = None
    dstate_grace: float | None = None
    last_step: int | None = None
    majority_phase: str = ""
    phase_counts: dict[str, int] = {}
    silent: list[int] = []
    phases: dict[str, RankPhase] = {}
    process_states: dict[str, str] = {}
    """Stopped ranks' process state letters (a hang the agent's heartbeat revealed)."""
    truncated: bool = False
    resumed_at: float | None = None
    resumed_step: int | None = None


# -- performance -----------------------------------------------------------------------


class StragglerThresholds(msgspec.Struct, kw_only=True):
    straggler_ratio: float = 0.0
    straggler_z: float = 0.0
    straggler_patience: int = 0


class StragglerEvidence(_Evidence, kw_only=True):
    KIND: ClassVar[str] = "straggler"
    compute: float = 0.0
    rank_compute_median: float = 0.0
    job_compute_median: float = 0.0
    ratio: float = 0.0
    z: float = 0.0
    mad: float = 0.0
    flagged_steps: int = 0
    window: int = 0
    step_time_median: float = 0.0
    ranks_reporting: int = 0
    thresholds: StragglerThresholds = msgspec.field(default_factory=StragglerThresholds)
    resolved_ratio: float | None = None


class ThroughputDropEvidence(_Evidence, kw_only=True):
    KIND: ClassVar[str] = "throughput_drop"
    baseline: float = 0.0
    recent: float = 0.0
    ratio: float = 0.0
    throughput_drop: float = 0.0
    recent_steps: int = 0
    recovered: float | None = None


class DataStallEvidence(_Evidence, kw_only=True):
    KIND: ClassVar[str] = "data_stall"
    data_seconds: dict[str, float] = {}
    baseline_median: float = 0.0
    threshold: float = 0.0
    stalled_steps: int = 0
    window: int = 0
    data_stall_ratio: float = 0.0


class CheckpointSlowEvidence(_Evidence, kw_only=True):
    KIND: ClassVar[str] = "checkpoint_slow"
    seconds: float = 0.0
    usual: float = 0.0
    threshold: float = 0.0
    source: str = ""
    """``phase`` (a finished save), ``heartbeat`` (one in progress) or ``report``."""
    checkpoint_slow_ratio: float = 0.0
    next_save_seconds: float | None = None


# -- numerics --------------------------------------------------------------------------


class NonfiniteEvidence(_Evidence, kw_only=True):
    KIND: ClassVar[str] = "nonfinite"
    nonfinite_ranks: list[int] = []
    ranks_reporting: int = 0
    minority: bool = False
    """Fewer than half the reporting ranks saw it: before the all-reduce, so their
    hardware is suspect."""
    sdc_hint: bool = False
    loss: dict[str, float] = {}
    grad_norm: dict[str, float] = {}
    bad_batch_ranks: list[int] = []
    """Ranks whose batch check found NaN/Inf in their input at that step (the job lets bad
    batches train): where the values came from."""
    first_param: str = ""
    """Where the gradients went non-finite first, on ``first_rank`` ("" where no rank named
    one: a non-finite loss only, or a client that does not say)."""
    first_rank: int | None = None
    """The lowest bad rank that named a parameter."""
    param_basis: str = ""
    """How ``first_param`` was chosen on that rank: ``parameter`` (it holds NaN/Inf itself),
    ``backward`` (the first non-finite gradient in backward order) or ``forward`` (every
    gradient was non-finite: the values went bad before backward)."""
    params_affected: int = 0
    """Parameters whose gradients held NaN/Inf on ``first_rank``."""
    params: dict[str, list[str]] = {}
    """Per bad rank: the parameters it named, where they started first."""


BatchFaultKind = Literal["none", "empty", "nonfinite", "out_of_bounds", "dtype", "shape"]
"""What a rank's batch check found wrong with what its data phase produced: no batch,
an empty one, NaN/Inf values, values beyond the job's bound, a dtype or a shape (number
of dimensions) other than the first batch's."""


class BatchFault(msgspec.Struct, kw_only=True):
    """One bad batch, as the rank that checked it saw it (``StepReport.batch_fault``)."""

    kind: BatchFaultKind
    key: str = ""
    """Where in the batch (``input_ids``, ``[0]``, ``pixel_values``); empty: the batch."""
    sample: int | None = None
    """The first bad row of that tensor (its index along the batch dimension)."""
    sample_id: str = ""
    """The loader's id of that row, when the trainer passed the batch's ids."""
    source: str = ""
    """Where the batch came from (a file, a shard), when the trainer said."""
    detail: str = ""


class BadBatchEvidence(_Evidence, kw_only=True):
    """Ranks whose batch check failed at one step, before the forward pass."""

    KIND: ClassVar[str] = "bad_batch"
    faults: dict[str, BatchFault] = {}
    """By rank."""
    skipped: bool = False
    """The ranks skipped the step by agreement (nothing to roll back)."""


class _GradBaseline(_Evidence, kw_only=True):
    grad_norm: float = 0.0
    baseline_median: float = 0.0
    z: float = 0.0
    grad_z: float = 0.0
    window: int = 0


class GradExplosionEvidence(_GradBaseline, kw_only=True):
    KIND: ClassVar[str] = "grad_explosion"
    grad_explosion_ratio: float = 0.0
    top_params: dict[str, float] = {}
    """The parameters with the largest gradient norms on ``top_rank``, largest first (empty
    where no rank's own norm spiked against its recent median)."""
    top_rank: int | None = None
    """The rank with the largest gradient norm among those that named parameters."""


class GradVanishingEvidence(_GradBaseline, kw_only=True):
    KIND: ClassVar[str] = "grad_vanishing"
    grad_vanishing_ratio: float = 0.0
    steps: int = 0


class LossSpikeEvidence(_Evidence, kw_only=True):
    KIND: ClassVar[str] = "loss_spike"
    loss: float = 0.0
    baseline_median: float = 0.0
    mad: float = 0.0
    z: float = 0.0
    loss_z: float = 0.0
    loss_spike_rel: float = 0.0
    window: int = 0


class SdcMismatchEvidence(_Evidence, kw_only=True):
    KIND: ClassVar[str] = "sdc_mismatch"
    group: str = ""
    tie: bool = False
    suspects: list[int] = []
    majority_checksum: int | None = None
    votes: dict[str, int] = {}
    checksums: dict[str, int] = {}
    ranks_reporting: int = 0
    agreed_step: int | None = None
    """The group's newest round that agreed (raised: before the mismatch; cleared: the
    round that agreed again)."""
    found_step: int | None = None
    """The round that disagreed (the anomaly's step is the first after ``agreed_step``)."""


# -- hardware --------------------------------------------------------------------------


class XidSeen(msgspec.Struct, kw_only=True):
    code: int
    time: float = 0.0
    detail: str = ""


class EccRise(msgspec.Struct, kw_only=True):
    """An uncorrectable ECC counter that grew between two samples."""

    from_: int = msgspec.field(name="from")
    to: int


class GpuIdentity(msgspec.Struct, kw_only=True):
    uuid: str = ""
    name: str = ""
    temperature_c: float | None = None
    remapped_rows_pending: bool | None = None
    retired_pages_pending: bool | None = None


class GpuHealthEvidence(_Evidence, kw_only=True):
    """A fatal XID (see :mod:`trainguard.runtime.xids`) or rising uncorrectable ECC on one GPU."""

    KIND: ClassVar[str] = "gpu_health"
    host: str = ""
    gpu_index: int | None = None
    xids: list[XidSeen] = []
    ecc_uncorrected_volatile: EccRise | None = None
    ecc_uncorrected_aggregate: EccRise | None = None
    gpu: GpuIdentity | None = None
    fatal_xids: list[int] = []
    """The XIDs the detector counted as fatal for this job."""
    quiet_for: float | None = None
    """Set on resolution: seconds without new fatal evidence."""

    def ecc_rises(self) -> dict[str, EccRise]:
        """The counters that rose, by their ``GpuStats`` name."""
        rises = {"ecc_uncorrected_volatile": self.ecc_uncorrected_volatile,
                 "ecc_uncorrected_aggregate": self.ecc_uncorrected_aggregate}
        return {name: rise for name, rise in rises.items() if rise is not None}


# -- a host's reading (an agent's host probe, in its GpuSample) -------------------------


class IbPort(msgspec.Struct, kw_only=True):
    """One InfiniBand/RoCE port as sysfs gives it (``/sys/class/infiniband/<device>/ports/
    <port>/{state,phys_state,rate,link_layer}``)."""

    device: str
    port: int
    state: str = ""
    """``ACTIVE``, ``DOWN``, ``INIT``, ``ARMED`` (the number sysfs puts before it dropped)."""
    phys_state: str = ""
    """``LinkUp``, ``Polling``, ``Disabled``, ..."""
    rate_gbps: float | None = None
    rate: str = ""
    """The file's text, ``200 Gb/sec (4X HDR)``."""
    link_layer: str = ""
    """``InfiniBand`` or ``Ethernet`` (RoCE)."""

    @property
    def name(self) -> str:
        return f"{self.device}/{self.port}"


class CpuLoad(msgspec.Struct, kw_only=True):
    """The host's CPUs between two looks at ``/proc/stat``, and ``/proc/loadavg``."""

    steal_pct: float | None = None
    """Share of CPU time the hypervisor gave to others (None: one look only so far)."""
    busy_pct: float | None = None
    load1: float | None = None
    runnable: int | None = None
    """Runnable tasks now (``/proc/loadavg``'s fourth field, before the slash)."""
    cpus: int = 0
    window_s: float = 0.0


class KernelLine(msgspec.Struct, kw_only=True):
    """A kernel log line about the GPUs' health: an Xid, or a memory error."""

    text: str
    xid: int | None = None
    pci: str = ""
    kind: str = ""
    """``xid`` or ``ecc``."""
    since_boot: float | None = None
    """When it was logged, seconds since boot (kmsg's or dmesg's own stamp; None: not
    stamped, as in a wall-clock ``dmesg -T``)."""


class ForeignProcess(msgspec.Struct, kw_only=True):
    """A compute process on one of the node's GPUs that is none of the job's ranks."""

    gpu: int
    pid: int
    name: str = ""
    user: str = ""


class HostFacts(msgspec.Struct, kw_only=True):
    """What an agent's host probe read besides the GPU counters: what the diagnoser's
    straggler checklist needs (section 6) and the pre-flight checks read too."""

    ib_ports: list[IbPort] = []
    ib_expected_gbps: float = 0.0
    """The rate a port must reach (the agent's ``preflight_ib_rate_gbps``); 0: the best
    rate among the host's ports of the same link layer."""
    cpu: CpuLoad | None = None
    kernel: list[KernelLine] = []
    """Xid and memory-error lines of the kernel log the probe has seen (newest last)."""
    uptime_s: float | None = None
    """Seconds since boot when read: what the kernel lines' ``since_boot`` is against."""
    foreign: list[ForeignProcess] = []


# -- flight recorder -------------------------------------------------------------------


class FlightRecorderEvidence(msgspec.Struct, kw_only=True):
    """The c10d flight-recorder dumps of some ranks (an agent's, for the diagnoser), and
    what they say about a hang (:func:`trainguard.analysis.flightrec.analyse`, by the diagnoser).

    Not an anomaly kind's evidence: agents publish it in a ``FlightRecorderReport`` when
    asked for a ``dump``, and the diagnoser attaches the analysis to the hang's diagnosis.
    """

    asked: list[int] = []
    """Ranks whose dumps were requested; a rank asked with no record is missing."""
    records: list[RankRecord] = []
    analysis: Analysis | None = None


Evidence: TypeAlias = (
    CrashEvidence | UnresponsiveEvidence | GpuHealthEvidence | HangEvidence
    | StragglerEvidence | NonfiniteEvidence | GradExplosionEvidence | GradVanishingEvidence
    | LossSpikeEvidence | SdcMismatchEvidence | ThroughputDropEvidence | DataStallEvidence
    | CheckpointSlowEvidence | BadBatchEvidence
)
BY_KIND: Final[dict[str, type[Evidence]]] = {t.KIND: t for t in (
    CrashEvidence, UnresponsiveEvidence, GpuHealthEvidence, HangEvidence, StragglerEvidence,
    NonfiniteEvidence, GradExplosionEvidence, GradVanishingEvidence, LossSpikeEvidence,
    SdcMismatchEvidence, ThroughputDropEvidence, DataStallEvidence, CheckpointSlowEvidence,
    BadBatchEvidence,
)}
"""The evidence Struct of each ``AnomalyKind``."""

if TYPE_CHECKING:
    EvidenceField: TypeAlias = Evidence
else:
    EvidenceField = Any  # what msgspec decodes: a plain object, typed in __post_init__


def unset_evidence() -> Evidence:
    """Default of ``Anomaly.evidence``: an empty object, typed by kind in __post_init__."""
    return cast("Evidence", {})


def typed_evidence(kind: str, value: object) -> Evidence:
    """``value`` as the evidence Struct of ``kind``.

    A decoded (or hand-written) object is converted, leniently like the rest of a durable
    message (``"nan"`` strings become floats, unknown keys are ignored); a Struct must
    already be the kind's. Raises ValueError or TypeError, which msgspec reports as a
    validation error of the anomaly.
    """
    cls = BY_KIND.get(kind)
    if cls is None:
        raise ValueError(f"no evidence type for anomaly kind {kind!r}")
    if isinstance(value, cls):
        return value
    if isinstance(value, dict):
        try:
            return msgspec.convert(value, cls, strict=False)
        except msgspec.ValidationError as exc:
            raise ValueError(f"evidence of a {kind} anomaly: {exc}") from None
    raise TypeError(f"evidence of a {kind} anomaly must be an object or a {cls.__name__}, "
                    f"not {type(value).__name__}")
