"""The fault schedule of the demo and the chaos suite, with what each fault should produce.

One table serves ``trainguard demo``, ``tests/e2e/test_chaos.py`` and the benchmark, so
they can never disagree about what "detected, diagnosed and recovered" means (docs/design.md
section 6, "Expected outcomes of the drills").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Recovery = Literal["alert", "step_past", "world_shrinks", "fingerprints_agree"]


@dataclass(frozen=True)
class Fault:
    name: str
    kind: str
    """The drill command (rank-side: slow, hang, nan, sdc, crash; agent-side: freeze, xid)."""
    rank: int | None = None
    host: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    anomaly: str = ""
    causes: tuple[str, ...] = ()
    """Accepted causes (the first is the one the design table names)."""
    actions: tuple[str, ...] = ()
    """Actions that must have run (done or skipped with a reason) for the incident."""
    recovery: Recovery = "step_past"
    undo: tuple[str, dict[str, Any]] | None = None
    """A command that ends the fault once it is detected (a slow rank speeds up again)."""
    timeout: float = 300.0
    """Detection to recovery: generous, since a restart on a loaded machine (torch imported
    anew by every rank, the group re-formed) can take minutes."""



ECC_MESSAGE = "RuntimeError: CUDA error: uncorrectable ECC error encountered"

# Ranks 0-1 run on node-a (the rendezvous store host), 2-3 on node-b.
FAULTS: dict[str, Fault] = {f.name: f for f in (
    Fault("straggler", "slow", rank=1, params={"factor": 2.0}, anomaly="straggler",
          causes=("straggler",), actions=("alert",), recovery="alert",
          undo=("slow", {"factor": 1.0})),
    Fault("hang", "hang", rank=1, params={"phase": "data", "seconds": 3600},
          anomaly="hang", causes=("rank_hang",), actions=("dump", "restart")),
    Fault("sigstop", "freeze", rank=1, host="node-a", anomaly="hang", causes=("rank_hang",),
          actions=("dump", "restart")),
    Fault("ecc_crash", "crash", rank=1, params={"message": ECC_MESSAGE}, anomaly="crash",
          causes=("hbm_ecc",), actions=("restart",)),
    Fault("nan", "nan", rank=0, anomaly="nonfinite", causes=("numeric",),
          actions=("rollback", "restart")),
    Fault("sdc", "sdc", rank=1, params={"bit": 20}, anomaly="sdc_mismatch",
          causes=("sdc_suspect",), actions=("rollback",), recovery="fingerprints_agree"),
    Fault("kill", "kill", rank=1, host="node-a", anomaly="crash", causes=("process_crash",),
          actions=("restart",)),
    Fault("ecc", "ecc", host="node-a", params={"count": 2}, anomaly="gpu_health",
          causes=("hbm_ecc",), actions=("restart",)),
    Fault("xid79", "xid", host="node-b", params={"code": 79}, anomaly="gpu_health",
          causes=("gpu_lost",), actions=("isolate",), recovery="world_shrinks"),
)}
"""In the order the combined run plays them: node-b's isolation comes last."""

DEFAULT_SCHEDULE: tuple[str, ...] = tuple(FAULTS)


def parse_faults(spec: str) -> list[Fault]:
    """``all``, ``none`` or a comma-separated list of fault names (with ``@rank=N``)."""
    if spec in ("", "none"):
        return []
    if spec == "all":
        return [FAULTS[n] for n in DEFAULT_SCHEDULE]
    out = []
    for item in spec.split(","):
        name, _, rank = item.strip().partition("@rank=")
        if name not in FAULTS:
            raise ValueError(f"unknown fault {name!r}; known: {', '.join(FAULTS)}")
        f = FAULTS[name]
        if rank:
            r = int(rank)
            f = Fault(**{**f.__dict__, "rank": r,
                         "host": ("node-a" if r < 2 else "node-b") if f.host else None})
        out.append(f)
    return out
