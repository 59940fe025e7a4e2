"""How right the exit-text knowledge is on labelled real lines.

A table (JSON lines, ``{"cause", "family", "url", "text"}``) holds error lines users posted
in public threads, each labelled with the cause a platform engineer names. Every row goes
through :meth:`.rules.Diagnoser.classify` as one rank's crash (exit code 1, the line as its
stderr tail), and is scored honestly: a row is right when a signature (or an Xid, or the
host's evidence) named its cause. The fallback, ``process_crash`` because nothing was
recognised, is right only on rows labelled :data:`UNRECOGNISED` (text that names no cause),
never by landing on a row whose cause happens to be ``process_crash``.

Used by the fixture tests and by ``bench/bench_diagnosis.py``.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from trainguard.contract.errors import TrainguardError
from trainguard.contract.evidence import CrashEvidence
from trainguard.contract.schemas import Anomaly

from .rules import Diagnoser
from .signatures import CAUSES

UNRECOGNISED: Final = "unrecognised"
"""The label of a line that names no cause: the only rows the fallback gets right."""
FAMILIES: Final = {
    "storage": "storage I/O of checkpoint writes and loads",
    "loss_scale": "loss-scale overflow and divergence of the mixed-precision stacks",
    "nonfinite": "NaN/Inf in the loss or the gradient norm",
    "host_memory": "host memory pressure and the OOM killer",
    "gpu_memory": "device memory exhausted",
    "dataloader": "data-loader workers, the pin-memory thread, shared memory",
    "gpu_hardware": "GPU and bus hardware errors from the kernel log or CUDA",
    "cuda_runtime": "CUDA runtime errors, old and new style",
    "collective": "collective timeouts, watchdogs, desynced and vanished peers",
    "network_config": "NCCL/gloo transport and network configuration",
    "application": "the program's own errors and crashes",
}
"""Row families: the report groups accuracy by them."""
LABELS: Final = CAUSES | {UNRECOGNISED}
NOW: Final = 1_000_000.0


class TableError(TrainguardError):
    """A row of a labelled table is malformed (the message names the file, line and fix)."""


@dataclass(frozen=True)
class Row:
    cause: str
    family: str
    url: str
    text: str


@dataclass(frozen=True)
class Verdict:
    row: Row
    cause: str
    recognised: bool
    fact: str
    """What the diagnoser said of the text (the fact it quoted last)."""

    @property
    def right(self) -> bool:
        if self.row.cause == UNRECOGNISED:
            return not self.recognised
        return self.recognised and self.cause == self.row.cause


def load(path: Path) -> list[Row]:
    """The table's rows, each checked: a bad row raises naming its line and the fix."""
    rows = []
    for n, line in enumerate(path.read_text("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path.name}:{n}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TableError(f"{where}: not JSON ({exc}); one object per line") from None
        if not isinstance(data, dict) or set(data) != {"cause", "family", "url", "text"}:
            raise TableError(f"{where}: keys must be exactly cause, family, url, text")
        if data["cause"] not in LABELS:
            raise TableError(f"{where}: cause {data['cause']!r} is not a contract Cause "
                             f"nor {UNRECOGNISED!r}")
        if data["family"] not in FAMILIES:
            raise TableError(f"{where}: family {data['family']!r}; one of "
                             f"{', '.join(FAMILIES)}")
        if not str(data["url"]).startswith("https://") or not str(data["text"]).strip():
            raise TableError(f"{where}: url must be the https:// thread the text was "
                             "posted in, and text not empty")
        rows.append(Row(data["cause"], data["family"], data["url"], data["text"]))
    return rows


def judge(row: Row, diagnoser: Diagnoser | None = None) -> Verdict:
    """Classify ``row`` as rank 0's crash with the line as its stderr tail."""
    a = Anomaly(id="a0", job="j", kind="crash", ranks=[0], hosts=["node-a"],
                evidence=CrashEvidence(source="worker_exit", exit_code=1, stderr_tail=row.text),
                onset_at=NOW - 5, detected_at=NOW - 1)
    v = (diagnoser or Diagnoser()).classify(a, NOW)
    return Verdict(row, v.cause, v.recognised, v.facts[-1].fact if v.facts else "")


@dataclass
class Score:
    right: Counter[str] = field(default_factory=Counter)
    total: Counter[str] = field(default_factory=Counter)
    misses: list[Verdict] = field(default_factory=list)

    def add(self, v: Verdict) -> None:
        self.total[v.row.family] += 1
        if v.right:
            self.right[v.row.family] += 1
        else:
            self.misses.append(v)

    @property
    def accuracy(self) -> float:
        n = sum(self.total.values())
        return sum(self.right.values()) / n if n else 0.0


def score(rows: list[Row]) -> Score:
    s = Score()
    for row in rows:
        s.add(judge(row))
    return s
