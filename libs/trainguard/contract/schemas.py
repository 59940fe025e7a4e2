"""Every message on the bus, as msgspec Structs (v1 of each).

Two families, encoded differently (docs/design.md, section 3):

* Telemetry (``Heartbeat``, ``StepReport``, ``Fingerprint``, ``GpuSample``,
  ``NodeHeartbeat``, ``SnapshotReport``) is high-rate and fire-and-forget: MessagePack, with a tag
  ``<type>.v<N>`` that carries the version, no headers.
* Durable messages (events, commands, acks, exits, checkpoint reports, hellos, dead
  letters) travel on JetStream as JSON with CloudEvents headers; ``ce-type`` =
  ``io.trainguard.<kind>.v<major>`` is authoritative and the body's ``schema`` field
  mirrors it.

Wire types never forbid unknown fields, so an old reader tolerates a newer writer that
added a field. Entities that change (an anomaly resolved, an incident moving on) are
republished with the same ``id``, a higher ``rev`` and a new ``status``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Final, Literal, get_args

import msgspec

from .evidence import (
    BatchFault,
    EvidenceField,
    FlightRecorderEvidence,
    HostFacts,
    typed_evidence,
    unset_evidence,
)

# -- telemetry (MessagePack, tagged) ---------------------------------------------------


class Telemetry(msgspec.Struct, tag_field="t", kw_only=True):
    """Fields every telemetry message carries.

    ``time`` is the sender's clock and ``seq`` its sequence number: a client that
    reconnects delivers buffered messages late, so receivers judge by these, never by
    arrival time.
    """

    job: str
    time: float
    seq: int = 0


class Heartbeat(Telemetry, tag="hb.v1"):
    rank: int
    attempt: int = 0
    host: str = ""
    pid: int = 0
    step: int | None = None
    phase: str | None = None
    phase_elapsed: float = 0.0
    coll_seq: int = 0
    coll_done: int = 0
    dropped: int = 0
    quiet_for: float = 0.0
    """Seconds the current phase has shown no work: no CPU time and no bytes read or
    written by the process (less trainguard's own threads) or its children (the data
    loader's workers). 0 while it works, and where it is not known (a phase younger than
    a tenth of a second or than the usual step, no ``/proc``). A loader stuck, not
    refilling."""


RECOVERING_PHASE = "recovering"
"""The heartbeat phase of a rank that lost a peer and waits for its group to re-form in
place (``trainguard.torch``'s recovery): the detector holds its hang judgement meanwhile,
for at most its ``recovery_timeout``."""


class StepReport(Telemetry, tag="step.v1"):
    rank: int
    step: int
    attempt: int = 0
    duration: float = 0.0
    phases: dict[str, float] = {}
    loss: float | None = None
    grad_norm: float | None = None
    nonfinite: int = 0
    nonfinite_params: list[str] = []
    """After a non-finite grad norm: parameters whose gradients hold NaN/Inf, where they
    started first (``trainguard.torch.stats.nonfinite_grad_origin``), at most 5."""
    nonfinite_count: int = 0
    """How many parameters' gradients hold NaN/Inf (0: not examined)."""
    nonfinite_basis: str = ""
    """How ``nonfinite_params[0]`` was chosen: ``parameter`` (it holds NaN/Inf itself),
    ``backward`` (the first non-finite gradient in backward order) or ``forward`` (every
    gradient is non-finite: the values went bad before backward)."""
    spike_params: dict[str, float] = {}
    """After a gradient norm spike on this rank (above ``grad_spike_factor`` times its recent
    median): the parameters with the largest gradient norms, largest first."""
    tokens: int | None = None
    samples: int | None = None
    steps: int = 1
    extra: dict[str, float] = {}
    world_size: int = 0
    """The job's size this rank runs in (0: not told). A change re-forms the job."""
    lr: float | None = None
    """The learning rate of the step, when the trainer's optimizer tells it."""
    batch_fault: BatchFault | None = None
    """What this rank's batch check found wrong with the step's batch."""
    skipped: bool = False
    """The ranks skipped the step (a bad batch): no update; loss and grad norm unset."""


class Fingerprint(Telemetry, tag="fp.v1"):
    """A checksum of the state this rank holds at ``step``, compared only among the ranks
    that hold the same state (``group``)."""

    rank: int
    step: int
    checksum: int
    attempt: int = 0
    group: str = "dp"
    """The replica group: ranks with equal ``group`` hold bit-equal state. ``dp`` is the
    whole job (plain data parallelism); a sharded job names the shard (``shard=1``)."""
    group_size: int = 0
    """How many ranks hold that state (0: an older client; the whole job is assumed)."""


class GpuStats(msgspec.Struct, kw_only=True):
    """One GPU's counters in a :class:`GpuSample`; absent readings are None."""

    index: int
    uuid: str = ""
    name: str = ""
    temperature_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    sm_clock_mhz: float | None = None
    throttle_reasons: list[str] = []
    util_pct: float | None = None
    mem_used: int | None = None
    mem_total: int | None = None
    ecc_corrected_volatile: int | None = None
    ecc_uncorrected_volatile: int | None = None
    ecc_corrected_aggregate: int | None = None
    ecc_uncorrected_aggregate: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_pending: bool | None = None
    pcie_replay: int | None = None
    nvlink_errors: int | None = None
    remapped_rows_failure: bool | None = None
    """A row remap failed (the bank ran out of spare rows): the GPU needs replacing."""
    pcie_gen: int | None = None
    """The PCIe link generation now; it drops when the GPU idles, so below the maximum it
    is no fault by itself."""
    pcie_gen_max: int | None = None
    pcie_width: int | None = None
    """The PCIe link width now (lanes); below the maximum is a degraded link."""
    pcie_width_max: int | None = None
    processes: list[int] = []
    """Pids of the compute processes on this GPU (whoever owns them)."""


class XidEvent(msgspec.Struct, kw_only=True):
    gpu: int
    code: int
    time: float
    detail: str = ""


class GpuSample(Telemetry, tag="gpu.v1"):
    """An agent's periodic look at its node: its GPUs, and (``host``) what else can slow a
    rank there (InfiniBand ports, CPU steal and load, kernel log lines, foreign processes
    on the GPUs). The diagnoser keeps a window of them per host (section 6)."""

    host: str
    gpus: list[GpuStats] = []
    xids: list[XidEvent] = []
    source: str = "nvml"
    facts: HostFacts | None = None
    """The host probe's reading (None from older agents)."""


ProcessState = Literal["R", "S", "D", "T", "t", "Z", "X", "x", "I", "P", "K", "W"]
"""A worker's Linux state letter, as ``/proc/<pid>/stat`` gives it (every letter a kernel
reports, old ones included, so no agent can send one a detector rejects); ``X`` also when
the pid is gone. Written by the agent, judged by the detector, stored in ``progress``."""
PROCESS_STATES: frozenset[str] = frozenset(get_args(ProcessState))
STOPPED_STATES: frozenset[ProcessState] = frozenset({"T", "t", "D"})
"""Cannot make progress: stopped by a signal (T) or a tracer (t), or in uninterruptible
sleep (D). Such a worker also ignores SIGTERM until it runs again. T is SIGSTOP and lasts;
t and D are often brief (a profiler, a disk write)."""
GONE_STATES: frozenset[ProcessState] = frozenset({"Z", "X", "x"})
"""Dead (X, x) or a zombie nobody reaped yet (Z)."""


def is_stopped(state: str | None) -> bool:
    return state in STOPPED_STATES


def is_gone(state: str | None) -> bool:
    return state in GONE_STATES


class NodeHeartbeat(Telemetry, tag="node.v1"):
    """The agent's view of its local ranks: process state letter by rank.

    ``restarting``: the worker group is being restarted (a worker failed, or a ``restart``
    command came) and the new one has not started yet, since ``restarting_since`` (the
    agent's clock): the detector reads the ranks' silence then as the restart, not as
    failing ranks. Both default to "not restarting", so old agents and readers interoperate.
    """

    host: str
    ranks: dict[int, ProcessState] = {}
    pids: dict[int, int] = {}
    attempt: int = 0
    restarting: bool = False
    restarting_since: float | None = None
    generation: int = 0
    """The job's process-group generation this node's ranks belong to (0: an old agent)."""
    spares: list[int] = []
    """The pids of the node's idle warm spares that are ready (one becomes a rank on a
    restart, keeping its pid)."""


class SnapshotReport(Telemetry, tag="snap.v1"):
    """A rank's memory snapshots (``trainguard.torch.snapshots``) after one was taken and
    verified (its background checksum and finiteness check passed): at most about one a
    second per rank, the newest. The checkpoint coordinator keeps the newest per rank and
    shows the steps every rank holds beside the committed checkpoints."""

    rank: int
    step: int
    """The step the snapshot holds the state after."""
    attempt: int = 0
    taken: float = 0.0
    """When the snapshot was taken (the rank's clock; ``time`` is when this was sent)."""
    bytes: int = 0
    """The size of that one snapshot (this rank's share of the state)."""
    copy_seconds: float = 0.0
    """What the copy cost the training loop."""
    check_seconds: float = 0.0
    """The checksum and finiteness check, off the training loop (CPU seconds)."""
    every: int = 0
    """Steps between snapshots now (``every="auto"`` moves it with the measured cost)."""
    kept_steps: list[int] = []
    """The steps of the clean, checked snapshots this rank holds, oldest first."""
    oldest_taken: float = 0.0
    """When the oldest of them was taken (how far back in time a rollback reaches)."""
    host_bytes: int = 0
    """Host memory the kept snapshots hold on this rank."""
    world_size: int = 0
    """The job's size this rank runs in (0: not told)."""
    buddy: int = -1
    """The rank on another host this rank's snapshots are copied to (-1: none)."""
    buddy_sent: list[int] = []
    """The steps of the last copies the buddy acknowledged, oldest first."""
    buddy_held: dict[int, list[int]] = {}
    """rank -> the steps of the copies of its snapshots this rank holds, oldest first."""
    buddy_bytes: int = 0
    """Host memory those copies take on this rank (besides ``host_bytes``)."""


TelemetryMessage = Heartbeat | StepReport | Fingerprint | GpuSample | NodeHeartbeat | \
    SnapshotReport

# -- durable (JSON + CloudEvents) ------------------------------------------------------


PREFLIGHT_CHECKS: Final = ("nvml", "dcgm", "ib", "allreduce", "disk")
"""Every pre-flight check (``preflight_checks``, a ``preflight`` command's
``params.checks``), in the order they run."""
PASSIVE_PREFLIGHT_CHECKS: Final = ("nvml", "ib")
"""The checks a ``preflight`` command runs beside training: readings only (the bandwidth
test, ``dcgmi diag`` and the disk test compete with the ranks for the devices)."""

CheckStatus = Literal["ok", "warn", "fail", "skipped"]
"""A pre-flight check's verdict: ``skipped`` says why it could not run (no GPU, no DCGM,
no torch), never that the node is fine."""


class PreflightCheck(msgspec.Struct, kw_only=True):
    """One check of a node's pre-flight (:mod:`trainguard.health.checks`)."""

    name: str
    """``<check>`` or ``<check>:<subject>`` (``ib:mlx5_0/1``, ``nvml.pcie:gpu0``)."""
    status: CheckStatus
    value: Any = None
    """What was measured (a count, a rate, a list of reasons)."""
    threshold: Any = None
    """What it was held against."""
    reason: str = ""
    seconds: float = 0.0


class Durable(msgspec.Struct, kw_only=True):
    """Base of every JetStream message; ``KIND`` and ``VERSION`` make up ``ce-type``."""

    KIND: ClassVar[str] = ""
    VERSION: ClassVar[int] = 1
    schema: str = ""

    def __post_init__(self) -> None:
        if not self.schema:
            self.schema = self.ce_type()

    @classmethod
    def ce_type(cls) -> str:
        return f"io.trainguard.{cls.KIND}.v{cls.VERSION}"


AnomalyKind = Literal[
    "crash", "unresponsive", "gpu_health", "hang", "straggler", "nonfinite",
    "grad_explosion", "grad_vanishing", "loss_spike", "sdc_mismatch",
    "throughput_drop", "data_stall", "checkpoint_slow", "bad_batch",
]
Cause = Literal[
    "gpu_lost", "hbm_ecc", "network", "storage_io", "oom", "numeric", "sdc_suspect",
    "straggler_thermal", "straggler_power", "straggler_link", "straggler_cpu",
    "straggler_foreign_process", "straggler", "data_pipeline",
    "process_crash", "rank_hang", "hosts_lost", "unknown",
]
Severity = Literal["info", "warning", "critical"]
# Who runs which command kind (docs/design.md, section 3). Each receiver ignores the others'.
# The Literals are the vocabulary; the frozensets are derived from them, never listed twice.
# ``Command.kind`` stays ``str`` on the wire: a trainer's own kinds (``guard.on("note",
# ...)``) must decode too.
AgentDrill = Literal["kill", "freeze", "thaw", "ecc", "xid", "throttle"]
"""Faults the agent plays on its ranks' processes and (scripted) GPUs."""
AgentKind = Literal["restart", "isolate", "stop", "hold", "dump", "preflight", AgentDrill]
RankDrill = Literal["hang", "slow", "nan", "sdc", "crash", "corrupt_copies"]
"""Faults a rank plays on itself (:mod:`trainguard.client.drills`). ``corrupt_copies``: a
byte flips in every buddy copy of a snapshot the rank holds and receives from then on (its
memory goes bad)."""
CollectiveKind = Literal["save_now", "set_interval", "reload"]
"""Kinds every rank must run at the same step (``at_step`` or the side-group agreement).
``reload``: load the committed checkpoint ``params.step`` in-process and go on from the
step after it (a rollback without restarting a process)."""
RankKind = Literal[CollectiveKind, RankDrill]
CommandKind = Literal[AgentKind, RankKind]
AGENT_KINDS: frozenset[str] = frozenset(get_args(AgentKind))
RANK_KINDS: frozenset[str] = frozenset(get_args(RankKind))
COLLECTIVE_KINDS: frozenset[str] = frozenset(get_args(CollectiveKind))
RANK_DRILLS: frozenset[str] = frozenset(get_args(RankDrill))
AGENT_DRILLS: frozenset[str] = frozenset(get_args(AgentDrill))
AckOutcome = Literal["done", "failed", "too_late", "unknown_kind", "refused"]
Issuer = Literal["remediator", "coordinator", "cli"]
"""Who issues commands: the remediator's leader, the checkpoint coordinator (with the
remediator's epoch), and an operator's drills (``trainguard inject``, the demo)."""
ISSUERS: frozenset[str] = frozenset(get_args(Issuer))


class Attempt(msgspec.Struct, kw_only=True):
    """Which incarnation of a rank this is: steps and sequences restart with it."""

    restart_count: int = 0
    pid: int = 0
    started_at: float = 0.0
    generation: int = 0
    """The job's process-group generation it joined (``TRAINGUARD_GENERATION``)."""


class RankHello(Durable, kw_only=True):
    KIND: ClassVar[str] = "rank_hello"
    job: str
    rank: int
    world_size: int
    local_rank: int = 0
    host: str = ""
    pid: int = 0
    attempt: Attempt = msgspec.field(default_factory=Attempt)
    env: dict[str, str] = {}
    time: float = 0.0


class NodeHello(Durable, kw_only=True):
    KIND: ClassVar[str] = "node_hello"
    job: str
    host: str
    local_ranks: list[int] = []
    nnodes_min: int = 1
    nnodes_max: int = 1
    drills_allowed: bool = False
    hosts_store: bool = False
    pid: int = 0
    time: float = 0.0
    left: bool = False
    """The launcher exited (``time``: when): published once on the way out, so the control
    plane drops the host from the job. Old readers ignore it; old agents never send it."""


class WorkerExit(Durable, kw_only=True):
    KIND: ClassVar[str] = "worker_exit"
    id: str
    job: str
    host: str
    rank: int
    local_rank: int = 0
    pid: int = 0
    exit_code: int | None = None
    signal: str | None = None
    stderr_tail: str = ""
    error: str = ""
    initiated_by: str | None = None
    attempt: int = 0
    generation: int = 0
    """The job's process-group generation the rank ran in (0: an older agent): job-wide,
    every host draws it from the rendezvous, unlike ``attempt`` (its node's restart count).
    The restart budget counts ended groups by it (a rank replaced in place keeps its
    ``attempt`` but runs in a new generation)."""
    time: float = 0.0


class FlightRecorderReport(Durable, kw_only=True):
    """An agent's flight-recorder dumps of its ranks, collected on a ``dump`` command."""

    KIND: ClassVar[str] = "flight_recorder"
    id: str
    job: str
    host: str
    command_id: str = ""
    evidence: FlightRecorderEvidence = msgspec.field(default_factory=FlightRecorderEvidence)
    attempt: int = 0
    time: float = 0.0


class FileDigest(msgspec.Struct, kw_only=True):
    bytes: int
    crc32: int | None = None


class CheckpointReport(Durable, kw_only=True):
    KIND: ClassVar[str] = "checkpoint_report"
    id: str
    job: str
    rank: int
    step: int
    path: str
    world_size: int
    bytes: int = 0
    seconds_blocked: float = 0.0
    seconds_total: float = 0.0
    files: dict[str, FileDigest] = {}
    attempt: int = 0
    group_token: str = msgspec.field(default="", name="generation")
    """The worker group the save belongs to, the same on every rank of it (the
    Checkpointer's token, new at each re-form; ``generation`` on the wire); empty from older
    clients, which are told apart by ``attempt``. Not the launcher's group generation."""
    ok: bool = True
    error: str = ""
    time: float = 0.0
    state_since: float = 0.0
    """When this rank's training state last started over, by its clock: loaded from a
    checkpoint, or made fresh by a new process. A save at or past a rollback's step is
    trusted only from state that started over after the rollback: ranks still on the bad
    state may save again before their reload or restart reaches them. 0 from older clients
    (the save's start stands in)."""
    topology: Topology | None = None
    """How the saving job laid its state out (None from older clients)."""
    format: str = "dcp"
    """Who wrote the files: ``dcp`` (the Checkpointer; a DCP ``.metadata`` is required) or a
    framework's own format (``lightning``, ``hf``, ...), committed and verified the same
    way but loaded by that framework."""
    base: int | None = None
    """An incremental save: the step of the full checkpoint holding the tensors it did not
    write (``INCREMENT`` in its directory says which). None: a full save. The coordinator
    commits an increment only once its base is committed, and keeps the base as long as
    the increment."""


StateKind = Literal["replicated", "sharded", "hybrid"]
"""How a job holds its training state: every rank a full copy (DDP), each rank its own part
(FSDP, tensor parallel), or parts that are themselves replicated (HSDP, TP x DDP)."""


class Topology(msgspec.Struct, kw_only=True):
    """How the ranks that saved (or run) a job lay out its state: what a load at another
    size or mesh reshards from, and which ranks can stand in for which."""

    world_size: int
    kind: StateKind = "replicated"
    mesh_shape: list[int] = []
    """The device mesh the state is laid out on (empty: none, plain replicas)."""
    mesh_dims: list[str] = []
    """Its dimension names, in order (``dim<i>`` where the mesh names none)."""
    sharded_dims: list[str] = []
    """The dimensions along which ranks hold different parts of the state."""
    replicas: int = 1
    """How many ranks hold each part: the world size over the product of the sharded
    dimensions' sizes (1: no rank can give a lost rank's state back)."""

    def describe(self) -> str:
        """One line for logs, the catalogue and incidents."""
        if not self.mesh_shape:
            return f"{self.kind}, {self.world_size} ranks"
        mesh = " x ".join(f"{n}={s}" for n, s in zip(self.mesh_dims, self.mesh_shape,
                                                     strict=False))
        return (f"{self.kind}, {self.world_size} ranks, mesh {mesh}, sharded over "
                f"{','.join(self.sharded_dims) or 'nothing'}, {self.replicas} "
                f"replica{'s' if self.replicas != 1 else ''}")


RecoveryPath = Literal["in_place", "restart"]
"""How a job got back to work: its survivors kept running and re-formed the group with a
replacement (``in_place``), or every rank restarted from the last committed checkpoint."""
RecoveryTier = Literal["memory", "disk", "peer"]
"""Where a recovery's state came from: memory snapshots, a committed checkpoint, a peer."""
RecoveryKind = Literal["replace", "rollback", "resize", "grow", "resume"]
"""What the ranks recovered from: a lost rank replaced, a rollback to a committed
checkpoint, the group shrinking in place (a host left) or growing (a host taken back); or
how a restarted group came back (``resume``: the checkpoint it loaded, and any newer one it
could not load)."""


class RecoveryReport(Durable, kw_only=True):
    """A rank's account of one recovery, published by the lowest rank of the re-formed
    group once it runs again (or by a rank that gave in-place up, with ``path="restart"``
    and the reason), so the incident knows which path ran, what it cost and why."""

    KIND: ClassVar[str] = "recovery"
    id: str
    job: str
    rank: int
    kind: RecoveryKind = "replace"
    path: RecoveryPath = "in_place"
    reason: str = ""
    """Why in-place did not run (``path="restart"``), or what triggered it."""
    generation: int = 0
    """The generation of the re-formed group (``previous_generation`` before it)."""
    previous_generation: int = 0
    world_size: int = 0
    joined: list[int] = []
    """Ranks that took their state from a peer (the replacements)."""
    source_rank: int | None = None
    """The rank whose model and optimizer state the group continued with."""
    failed_step: int | None = None
    """The step the failure abandoned (None for a rollback)."""
    last_completed: int | None = None
    """The last step the group had completed before the failure."""
    resumed_step: int = 0
    """The first step the re-formed group runs."""
    steps_lost: int = 0
    """Completed steps the group runs again: ``last_completed - resumed_step + 1``, at
    least 0 (in place after a lost rank: 0)."""
    seconds: float = 0.0
    """From the failure reaching this rank to the group ready to run ``resumed_step``."""
    phases: dict[str, float] = {}
    """Where that time went, as this rank saw it: consecutive named phases in seconds, in
    order (in place: ``seen``, ``release``, ``teardown``, ``replacement`` (the agents'
    decision and the replacement's start), ``gathered``, ``formed``, ``rebuilt``,
    ``agreed``, ``state``, ``after``; a restarted group's ``resume``: from its agent's
    word of the failure to its first step, ``decision``, ``stop``, ``rendezvous``,
    ``spawn``, ``load``, ``first_step``, :mod:`trainguard.contract.timeline`; an agent's
    in-place ``replace``: from the failed rank's exit found to its replacement started,
    ``decision``, ``generation``, ``spare``)."""
    tier: RecoveryTier | Literal[""] = ""
    """Where the state came back from: ``memory`` (the ranks' memory snapshots),
    ``disk`` (a committed checkpoint), ``peer`` (a peer's live state); "" unknown."""
    attempt: int = 0
    time: float = 0.0


class PreflightReport(Durable, kw_only=True):
    """A node's pre-flight: published by ``trainguard launch`` before its ranks start (and
    on a ``preflight`` command, and by ``trainguard preflight``) on
    ``tg.<job>.event.preflight``; the remediator's policy blocklists a node that failed."""

    KIND: ClassVar[str] = "preflight"
    id: str
    job: str
    host: str
    status: Literal["ok", "warn", "fail"] = "ok"
    """``fail`` if any check failed, else ``warn`` if any warned, else ``ok``."""
    checks: list[PreflightCheck] = []
    trigger: Literal["launch", "command", "cli"] = "launch"
    seconds: float = 0.0
    time: float = 0.0

    def failed(self) -> list[PreflightCheck]:
        return [c for c in self.checks if c.status == "fail"]

    def reason(self) -> str:
        """The failed checks, one clause each, for a blocklist entry or a log line."""
        return "; ".join(f"{c.name}: {c.reason}" for c in self.failed())


class Anomaly(Durable, kw_only=True):
    KIND: ClassVar[str] = "anomaly"
    id: str
    job: str
    kind: AnomalyKind
    ranks: list[int] = []
    hosts: list[str] = []
    step: int | None = None
    onset_at: float
    detected_at: float
    severity: Severity = "warning"
    evidence: EvidenceField = msgspec.field(default_factory=unset_evidence)
    """The Struct of ``kind`` (:mod:`trainguard.contract.evidence`; why not a tagged union:
    there)."""
    status: Literal["open", "resolved"] = "open"
    rev: int = 1
    resolved_at: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.evidence = typed_evidence(self.kind, self.evidence)


class EvidenceItem(msgspec.Struct, kw_only=True):
    fact: str
    source: str
    value: Any = None


class Diagnosis(Durable, kw_only=True):
    KIND: ClassVar[str] = "diagnosis"
    id: str
    job: str
    anomaly_ids: list[str]
    cause: Cause
    confidence: float
    ranks: list[int] = []
    hosts: list[str] = []
    evidence: list[EvidenceItem] = []
    recommended: list[str] = []
    summary: str = ""
    onset_at: float | None = None
    step: int | None = None
    time: float = 0.0
    rev: int = 1
    status: Literal["open", "superseded"] = "open"
    superseded_by: str | None = None
    """A later diagnosis that found the root of the same failure (its anomaly ids include
    this one's)."""
    collateral: list[str] = []
    """Anomaly ids joined as consequences of this failure (a throughput drop while a rank
    straggles, a peer's error after a rank died): never a failure of their own."""
    worker_exited: bool = False
    """A worker's process ended in this failure (an exit report is among its anomalies),
    so a launcher restarts its group by itself; an ECC count read from NVML ends none."""
    domain: str = ""
    """``hosts_lost``: the failure domain its hosts share (``switch sw-3``); empty when no
    topology names one (the hosts were lost together, domain unknown)."""


class Action(Durable, kw_only=True):
    KIND: ClassVar[str] = "action"
    id: str
    job: str
    action: str
    incident_id: str = ""
    diagnosis_id: str = ""
    command_ids: list[str] = []
    status: Literal["sent", "acked", "failed", "skipped", "observed"] = "sent"
    """``observed``: decided and recorded, not carried out (the job's observe-only mode)."""
    detail: str = ""
    time: float = 0.0
    rev: int = 1


StepStatus = Literal["pending", "sent", "done", "failed", "skipped", "observed"]
"""``observed``: the step was decided and recorded ("would have ...") but not carried out,
because the job (or that action kind) is in observe-only mode (:class:`JobMode`)."""

RunMode = Literal["act", "observe"]
"""Whether the remediator carries out its decisions on a job (``act``) or only records and
announces them (``observe``): a platform team compares its calls with its own on-call's
before letting it act."""
ObservableAction = Literal["save_now", "dump", "isolate", "restart", "rollback", "hold"]
"""The policy actions that have an effect on a job, and so can be observed instead of
carried out. ``alert`` and ``escalate`` tell people and change nothing: they always run."""
OBSERVABLE_ACTIONS: Final = frozenset(get_args(ObservableAction))


class JobMode(msgspec.Struct, kw_only=True):
    """A job's remediation mode, as an operator set it (``trainguard observe`` / ``act``);
    the remediator reads it each time a step is about to take effect, so a switch needs no
    restart and holds across a failover (it is in Redis, not in a process)."""

    mode: RunMode = "act"
    actions: list[ObservableAction] = []
    """With ``observe``: only these kinds are observed, the rest act (empty: every one)."""
    by: str = ""
    """Who set it, and why (shown by ``trainguard observe --show``)."""
    time: float = 0.0

    def observed(self) -> frozenset[str]:
        """The action kinds this mode observes instead of carrying out."""
        if self.mode == "act":
            return frozenset()
        return frozenset(self.actions) or OBSERVABLE_ACTIONS


class HookRun(msgspec.Struct, kw_only=True):
    """One run of an operator's scheduler hook (the remediator's ``isolate_hook``: cordon
    a Kubernetes node, drain a Slurm node), kept on the incident step that ran it."""

    argv: list[str]
    status: Literal["ok", "failed", "timeout", "error"]
    """``failed``: non-zero exit; ``timeout``: killed after ``hook_timeout``; ``error``: it
    could not be started (no such program)."""
    exit_code: int | None = None
    output: str = ""
    """The tail of its stdout and stderr together."""
    elapsed: float = 0.0


class IncidentStep(msgspec.Struct, kw_only=True):
    """One step of an incident's plan, as the remediator runs it.

    A step is persisted as ``sent`` with its command id before the command goes out, so a
    new leader re-sends it as a retry (``retry_of``) instead of running it twice.
    """

    action: str
    """A policy action: save_now, dump, isolate, restart, rollback, alert or escalate."""
    params: dict[str, Any] = {}
    status: StepStatus = "pending"
    command_ids: list[str] = []
    detail: str = ""
    at: float | None = None
    """When the step started."""
    hook: HookRun | None = None
    """The scheduler hook this step ran (``isolate``), with its outcome."""


class RecoveryNote(msgspec.Struct, kw_only=True):
    """How an incident's job got back to work, from its ranks' and agents'
    :class:`RecoveryReport` (the newest that followed the failure)."""

    path: RecoveryPath
    """``in_place``: the survivors kept running; ``restart``: the group restarted cold."""
    kind: RecoveryKind = "replace"
    reason: str = ""
    """Why in place did not run (``restart``), or what the in-place recovery did."""
    generation: int = 0
    """The re-formed group's generation (in place)."""
    resumed_step: int | None = None
    steps_lost: int | None = None
    seconds: float | None = None
    """The failure reaching the ranks -> the group ready again (in place)."""
    back_at: float | None = None
    """When the job was back at work: ready in place, or (cold) training past the failure."""
    phases: dict[str, float] = {}
    """Where the time went (:attr:`RecoveryReport.phases`)."""
    agent_phases: dict[str, float] = {}
    """In place: the failed rank's agent's side, from the exit found to the replacement
    started (the phases of its ``replace`` report), inside the group's ``replacement``."""
    tier: RecoveryTier | Literal[""] = ""
    """Where the state came back from (:attr:`RecoveryReport.tier`)."""
    report_id: str = ""


class Incident(Durable, kw_only=True):
    KIND: ClassVar[str] = "incident"
    id: str
    job: str
    cause: Cause
    status: Literal["open", "mitigating", "resolved", "escalated", "failed"] = "open"
    """``failed``: the job was held, or every launcher of it exited, before it recovered."""
    rev: int = 1
    ranks: list[int] = []
    hosts: list[str] = []
    diagnosis_ids: list[str] = []
    anomaly_ids: list[str] = []
    onset_at: float | None = None
    detected_at: float | None = None
    diagnosed_at: float | None = None
    first_action_at: float | None = None
    mitigated_at: float | None = None
    resolved_at: float | None = None
    failure_step: int | None = None
    failure_attempt: int | None = None
    failure_generation: int | None = None
    """The job's process-group generation that failed (the detector's progress when the
    incident opened; None: unknown): the group an isolation of its lost hosts ends, as the
    restart budget counts it (``failure_attempt`` is the detector's incarnation)."""
    resume_step: int | None = None
    steps_lost: int | None = None
    restarted_attempt: int | None = None
    """The job's attempt when the remediator restarted it: resolution needs a later one."""
    recovery: RecoveryNote | None = None
    """Which recovery path ran, why, what it cost and when the job was back at work."""
    actions: list[IncidentStep] = []
    summary: str = ""
    escalation: str = ""
    signature: str = ""
    """The failure as on-call reads it: cause, culprit rank(s) and host(s), and the exit's
    last stderr line, from the newest diagnosis that had one."""
    domain: str = ""
    """The failure domain lost (``switch sw-3``), from its ``hosts_lost`` diagnosis."""
    worker_exited: bool = False
    """One of its diagnoses saw a worker's process end (:attr:`Diagnosis.worker_exited`)."""


class CheckpointCommitted(Durable, kw_only=True):
    KIND: ClassVar[str] = "checkpoint"
    id: str
    job: str
    step: int
    path: str
    status: Literal["committed", "failed", "suspect"] = "committed"
    world_size: int = 0
    bytes: int = 0
    missing_ranks: list[int] = []
    reason: str = ""
    time: float = 0.0


class Command(Durable, kw_only=True):
    KIND: ClassVar[str] = "command"
    id: str
    job: str
    kind: str
    issuer: str
    epoch: int = 0
    target: str = "all"
    params: dict[str, Any] = {}
    at_step: int | None = None
    deadline: float | None = None
    issued_at: float = 0.0
    retry_of: str | None = None
    seq: int = 0


class CommandAck(Durable, kw_only=True):
    KIND: ClassVar[str] = "command_ack"
    command_id: str
    job: str
    responder: str
    outcome: AckOutcome
    detail: str = ""
    kind: str = ""
    time: float = 0.0


class ResumePoint(Durable, kw_only=True):
    """Reply of ``<prefix>.<job>.rpc.resume``: the newest committed, verified checkpoint."""

    KIND: ClassVar[str] = "resume_point"
    job: str
    step: int
    path: str
    checkpoint_id: str = ""
    world_size: int = 0
    topology: Topology | None = None
    """How the saving job laid its state out (a load at another layout reshards)."""


class DeadLetter(Durable, kw_only=True):
    """A message that could not be processed, with why.

    ``payload`` is the message whole when it is small, else its first bytes
    (``truncated``): a letter must fit the server's ``max_payload``, and base64 in JSON
    makes bytes 4/3 as large. ``size`` and ``sha256`` are always those of the whole
    payload, so a truncated letter still identifies its message. Letters from before these
    fields read as ``size=0``, ``sha256=""``: unknown, the payload then being whole.
    """

    KIND: ClassVar[str] = "dead_letter"
    job: str
    subject: str
    reason: str
    service: str = ""
    consumer: str = ""
    payload: bytes = b""
    truncated: bool = False
    size: int = 0
    sha256: str = ""
    headers: dict[str, str] = {}
    deliveries: int = 0
    time: float = 0.0


DURABLE_TYPES: tuple[type[Durable], ...] = (
    RankHello, NodeHello, WorkerExit, FlightRecorderReport, CheckpointReport,
    RecoveryReport, PreflightReport, Anomaly,
    Diagnosis, Action, Incident, CheckpointCommitted, Command, CommandAck, ResumePoint, DeadLetter,
)
BY_CE_TYPE: dict[str, type[Durable]] = {t.ce_type(): t for t in DURABLE_TYPES}
