"""A checkpoint's record as the catalogue keeps it, parsed from its Redis hash.

Statuses: ``pending`` (reports arriving), ``committed`` (every rank reported and the files
verified), ``failed`` (a rank failed, ranks were missing at the deadline, or the files did
not verify), ``deleting``/``deleted`` (retention removed its files). A committed record may
also be *suspect* (``suspect`` holds why); only committed, non-suspect records can be the
resume point.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from trainguard.contract.codec import decode_durable
from trainguard.contract.errors import DecodeError
from trainguard.contract.schemas import CheckpointReport


def _f(raw: Mapping[str, str], name: str, default: float = 0.0) -> float:
    try:
        return float(raw.get(name) or default)
    except ValueError:
        return default


def _i(raw: Mapping[str, str], name: str, default: int = 0) -> int:
    try:
        return int(raw.get(name) or default)
    except ValueError:
        return default


@dataclass(frozen=True)
class Record:
    job: str
    step: int
    status: str
    round: str
    id: str
    path: str
    world_size: int
    attempt: int
    first_at: float
    deadline: float
    closed_at: float
    t0: float
    """Earliest sender time among the reports: when the save happened, by the ranks' clocks."""
    suspect: str
    retained: bool
    bytes: int
    seconds_blocked: float
    seconds_total: float
    reason: str
    missing_ranks: list[int]
    bad_ranks: list[int]
    point: str
    report_ids: dict[int, str] = field(default_factory=dict)
    base: int | None = None
    """An increment's base step (None: a full checkpoint, or not closed yet)."""

    @property
    def reported(self) -> list[int]:
        return sorted(self.report_ids)

    def missing(self) -> list[int]:
        """Ranks of the world that have not reported (yet)."""
        return [r for r in range(self.world_size) if r not in self.report_ids]

    @property
    def good(self) -> bool:
        return self.status == "committed" and not self.suspect

    @property
    def label(self) -> str:
        """The status a person reads: suspect and expired are shown as such."""
        if self.status == "committed" and self.suspect:
            return "suspect"
        if self.status == "committed" and not self.retained:
            return "expired"
        return self.status

    def summary(self) -> dict[str, object]:
        """The catalogue entry (``trainguard checkpoints``, rpc ``checkpoints``)."""
        return {
            "step": self.step, "status": self.label, "id": self.id, "path": self.path,
            "world_size": self.world_size, "reported": self.reported,
            "missing_ranks": self.missing_ranks if self.status == "failed" else self.missing(),
            "failed_ranks": self.bad_ranks,
            "bytes": self.bytes, "seconds_blocked": self.seconds_blocked,
            "seconds_total": self.seconds_total, "suspect": self.suspect,
            "reason": self.reason, "first_at": self.first_at, "closed_at": self.closed_at,
            "attempt": self.attempt, "topology": self.topology,
            "kind": "full" if self.base is None else "incremental", "base": self.base,
        }

    @property
    def topology(self) -> dict[str, Any] | None:
        """The layout the checkpoint was saved from (in its resume point), if the ranks
        said."""
        if not self.point:
            return None
        try:
            point = msgspec.json.decode(self.point.encode())
        except msgspec.DecodeError:
            return None
        topology = point.get("topology") if isinstance(point, dict) else None
        return topology if isinstance(topology, dict) else None


def _ranks(raw: Mapping[str, str], name: str) -> list[int]:
    try:
        return [int(r) for r in json.loads(raw.get(name) or "[]")]
    except (ValueError, TypeError):
        return []


def parse_record(job: str, step: int, raw: Mapping[str, str]) -> Record | None:
    if not raw or "status" not in raw:
        return None
    ids = {int(k[2:]): v for k, v in raw.items() if k.startswith("i:") and k[2:].isdigit()}
    return Record(
        job=job, step=step, status=raw["status"], round=raw.get("round", "1"),
        id=raw.get("id", ""), path=raw.get("path", ""), world_size=_i(raw, "world_size"),
        attempt=_i(raw, "attempt"), first_at=_f(raw, "first_at"), deadline=_f(raw, "deadline"),
        closed_at=_f(raw, "closed_at"), t0=_f(raw, "t0"), suspect=raw.get("suspect", ""),
        retained=raw.get("retained", "1") == "1", bytes=_i(raw, "bytes"),
        seconds_blocked=_f(raw, "blocked"), seconds_total=_f(raw, "total"),
        reason=raw.get("reason", ""), missing_ranks=_ranks(raw, "missing"),
        bad_ranks=_ranks(raw, "bad_ranks"), point=raw.get("point", ""),
        report_ids=ids, base=int(raw["base"]) if raw.get("base", "").isdigit() else None,
    )


def parse_reports(raw: Mapping[str, str]) -> tuple[dict[int, CheckpointReport], list[str]]:
    """The reports stored in a record, by rank, and the problems decoding any of them."""
    reports: dict[int, CheckpointReport] = {}
    problems: list[str] = []
    for k, v in raw.items():
        if not (k.startswith("r:") and k[2:].isdigit()):
            continue
        try:
            reports[int(k[2:])] = decode_durable(v.encode(), CheckpointReport)
        except DecodeError as exc:
            problems.append(f"rank {k[2:]}: stored report unreadable ({exc.reason})")
    return reports, problems
