"""Redis state shared between parts: key names and the structs stored under them.

Only the owner writes each key (docs/design.md, section 11): the detector writes ``progress``,
the remediator the blocklist and incidents, the coordinator checkpoints. Values are JSON
(msgspec), so any tool can read them with ``redis-cli GET``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeAlias

import msgspec

from trainguard.contract.codec import decode_durable, encode_durable
from trainguard.contract.errors import DecodeError
from trainguard.contract.schemas import JobMode, NodeHello, ProcessState

RankState = Literal["ok", "slow", "hung", "silent", "exited", "stopped"]


class RankProgress(msgspec.Struct, kw_only=True):
    rank: int
    host: str = ""
    step: int | None = None
    phase: str | None = None
    phase_elapsed: float = 0.0
    state: RankState = "ok"
    process_state: ProcessState | None = None
    """The agent's letter for the rank's process, where an agent reports it."""
    last_seen: float = 0.0
    attempt: int = 0


class Progress(msgspec.Struct, kw_only=True):
    """The detector's once-a-second summary of a job: what at_step choices, incident
    resolution and ``trainguard status`` read instead of raw telemetry."""

    job: str
    time: float
    world_size: int = 0
    incarnation: int = msgspec.field(default=0, name="attempt")
    """How often the job started over (the detector's ``JobState.incarnation``): job-wide,
    unlike a rank's attempt (its node's torchrun restart count). ``attempt`` in Redis."""
    generation: int = 0
    """The newest process-group generation the job's agents and ranks reported (0:
    unknown): job-wide, drawn from the rendezvous, so it numbers the job's worker groups
    the way the launchers' worker exits do (the remediator's restart budget)."""
    last_step: int | None = None
    """Highest step any rank of the current incarnation completed."""
    min_step: int | None = None
    """Lowest step among live ranks: the job as a whole has passed it."""
    median_step_time: float | None = None
    ranks: dict[int, RankProgress] = {}


@dataclass(frozen=True, slots=True)
class Keys:
    """Every Redis key name, under one deployment prefix."""

    prefix: str = "tg"

    def _k(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    def jobs(self) -> str:
        """Set of known job names (from RankHello)."""
        return self._k("jobs")

    def progress(self, job: str) -> str:
        return self._k("progress", job)

    def recoveries(self, job: str) -> str:
        """Hash report id -> JSON ``RecoveryReport`` of the job's last hour (remediator)."""
        return self._k("recovery", job)

    def lease(self, role: str, job: str) -> str:
        """Per-job ownership lease of a partitioned service (e.g. the detector)."""
        return self._k("lease", role, job)

    def node(self, job: str, host: str) -> str:
        """JSON :class:`NodeRecord` of a host's agent; the remediator writes it from the
        agent's durable hellos (a ``left`` one stays as an expiring tombstone)."""
        return self._k("node", job, host)

    def instances(self, role: str) -> str:
        """Live instances of a partitioned service (e.g. detectors sharing jobs)."""
        return self._k(role, "instances")

    def cmd_seq(self, job: str) -> str:
        """Counter of collective-command sequence numbers (INCR), shared by all issuers."""
        return self._k("cmdseq", job)

    def epoch(self, role: str) -> str:
        """Fencing-token counter of a role's leader (INCR on each leadership)."""
        return self._k("epoch", role)

    def host_history(self, host: str) -> str:
        """Hash of a host's diagnoses: ``<cause>`` -> count, ``last_cause``, ``last_time``."""
        return self._k("hosthist", host)

    def incidents(self, job: str) -> str:
        """Hash incident id -> JSON Incident (steps in ``actions``); remediator only."""
        return self._k("incidents", job)

    def open_incidents(self) -> str:
        """Set of ``<job>|<incident id>`` still open or mitigating."""
        return self._k("incidents", "open")

    def restarts(self, job: str) -> str:
        """Sorted set of restart times (score) for the restart budget."""
        return self._k("restarts", job)

    def cause_times(self, job: str, cause: str) -> str:
        return self._k("causes", job, cause)

    def leader(self, role: str) -> str:
        return self._k("leader", role)

    def blocklist(self) -> str:
        """Hash host -> JSON :class:`BlocklistEntry`; written by the remediator only."""
        return self._k("blocklist")

    def modes(self) -> str:
        """Hash job -> JSON :class:`~trainguard.contract.schemas.JobMode`: whether the
        remediator acts on a job or only observes it; written by ``trainguard observe`` /
        ``trainguard act`` (the ``operator`` role), read by the remediator at each step."""
        return self._k("mode")

    def dedupe(self, role: str, job: str) -> str:
        """Hash of entity keys a service has already acted on (survives its restart)."""
        return self._k("dedupe", role, job)


_progress_decoder = msgspec.json.Decoder(Progress)


def encode_progress(p: Progress) -> bytes:
    return msgspec.json.encode(p)


def decode_progress(data: bytes | str) -> Progress:
    return _progress_decoder.decode(data)


# -- the blocklist and node records ---------------------------------------------------------


class BlocklistEntry(msgspec.Struct, kw_only=True):
    """Why a host may not (re)join jobs: a value of ``Keys.blocklist()``.

    The remediator writes it (fenced) when it isolates a host; agents read it at launch and
    on ``isolate``, ``trainguard status`` shows it; ``trainguard unblock`` ends one early
    (sets ``expires``), and the remediator deletes ended ones. An operator may write one by
    hand, so every field but the reason may be missing (no ``expires``: it never ends).
    """

    reason: str = ""
    cause: str = ""
    job: str = ""
    incident: str = ""
    time: float = 0.0
    expires: float = 0.0
    """When the entry ends by itself (unix time; the remediator's ``blocklist_ttl`` after
    ``time``); 0: it lasts until ``trainguard unblock``."""
    released_by: str = ""
    """Who ended it before its time (``trainguard unblock``): it no longer blocks, and the
    remediator removes it (running its release hook) on its next sweep."""

    def active(self, now: float) -> bool:
        """Whether the host is still blocked at ``now``: readers ignore an ended entry
        the remediator has not swept yet."""
        return not self.expires or now < self.expires


NodeRecord: TypeAlias = NodeHello
"""An agent's registration under ``Keys.node(job, host)``: the newest ``NodeHello`` it
announced itself with (kept by the remediator), stored as the JSON it travels as. The
remediator reads it to decide whether a host can leave the job (``isolate``)."""

_blocklist_decoder = msgspec.json.Decoder(BlocklistEntry)


def encode_blocklist_entry(entry: BlocklistEntry) -> bytes:
    return msgspec.json.encode(entry)


def decode_blocklist_entry(data: bytes | str) -> BlocklistEntry:
    """Raises :class:`~trainguard.contract.errors.DecodeError` for a value that is not an entry."""
    try:
        return _blocklist_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise DecodeError(f"bad blocklist entry: {exc}") from None


def read_blocklist_entry(data: bytes | str) -> BlocklistEntry:
    """For readers (agents, ``trainguard status``): a value an operator wrote by hand that
    is not an entry still blocks the host, with its text as the reason."""
    try:
        return decode_blocklist_entry(data)
    except DecodeError:
        text = data if isinstance(data, str) else data.decode(errors="replace")
        return BlocklistEntry(reason=text)


_mode_decoder = msgspec.json.Decoder(JobMode)


def encode_job_mode(mode: JobMode) -> bytes:
    return msgspec.json.encode(mode)


def read_job_mode(data: bytes | str) -> JobMode:
    """A stored mode; a value that is not one (written by hand, garbled) observes every
    action: when the operator's intent cannot be read, the safe side is to change nothing."""
    try:
        return _mode_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return JobMode(mode="observe", by=f"unreadable mode ({exc}): observing everything")


def encode_node_record(record: NodeRecord) -> bytes:
    return encode_durable(record)


def decode_node_record(data: bytes | str) -> NodeRecord:
    """Raises :class:`~trainguard.contract.errors.DecodeError` for a value that is not a record."""
    return decode_durable(data.encode() if isinstance(data, str) else data, NodeHello)
