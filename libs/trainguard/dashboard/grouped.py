"""The grouped view of a big job, as pure functions of the board's state.

At thousands of ranks one row per rank is unreadable and heavy to send, so the page gets
what on-call reads first: the TOP-N outliers (stuck or stopped ranks, then the slowest by
compute time against the median, then silent ones), per-group aggregates (a host, or a failure
domain whose hosts an incident lost together) with the calm groups collapsed into one line,
and, only when the heat map is open, one character per rank (:func:`cell_codes`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice
from typing import Any, Final

from trainguard.contract.schemas import Incident

from .rankview import COMM_PHASES, RankView

TOP_N: Final = 20
"""Outlier rows sent in full (with their step strip)."""
GROUPS_SHOWN: Final = 40
"""Groups listed one per line, worst first; the rest are summed into one collapsed line."""
RATIO_STEPS: Final = 10
"""Newest steps a rank's ratio to the median is judged over in the grouped view: enough to
see a straggler, few enough to stay cheap at 16k ranks."""
SLOW_RATIO: Final = 1.3
"""A rank this many times the median's compute is slow (the heat map's amber)."""
STOPPED_STATES: Final = frozenset({"T", "t", "D"})


@dataclass(frozen=True)
class Judged:
    """One rank as the grouped view reads it."""

    rank: int
    view: RankView
    ratio: float | None
    stuck: bool
    stopped: bool
    waiting: bool
    lost: bool

    @property
    def severity(self) -> int:
        """The outliers' first sort key: 0 stuck or stopped, 1 slow, 2 lost (a lost host's
        ranks are many and shown by their group), 3 the rest."""
        if self.stuck or self.stopped:
            return 0
        if (self.ratio or 0.0) >= SLOW_RATIO:
            return 1
        return 2 if self.lost else 3


def rank_ratio(r: RankView, medians: dict[int, float], last: int) -> float | None:
    """The median of a rank's compute over the median at the same step, over its ``last``
    steps: a step slow for everyone (the first, a checkpoint) makes no rank slow."""
    own = sorted(c / m for s, c, _ in islice(reversed(r.steps), last)
                 if (m := medians.get(s)))
    n = len(own)
    if not n:
        return None
    return round(own[n // 2] if n % 2 else (own[n // 2 - 1] + own[n // 2]) / 2, 2)


def judge(r: RankView, ratio: float | None, stuck_after: float, newest: float) -> Judged:
    """Stuck: long in its own phase (long in a collective is waiting for the stuck one, as
    the detector reads it); stopped: the agent says T or D; lost: silent that long."""
    in_comm = r.phase in COMM_PHASES
    long = r.phase_elapsed > stuck_after
    return Judged(rank=r.rank, view=r, ratio=ratio, stuck=long and not in_comm,
                  stopped=r.state in STOPPED_STATES, waiting=long and in_comm,
                  lost=bool(r.seen) and newest - r.seen > stuck_after)


def outliers(judged: list[Judged], n: int = TOP_N) -> list[Judged]:
    """Stuck or stopped first, then the slow, then lost, each slowest first by ratio."""
    return sorted(judged, key=lambda j: (j.severity, -(j.ratio or 0.0), j.rank))[:n]


def group_of(incidents: Iterable[Incident]) -> dict[str, str]:
    """host -> the failure domain it was lost with (``hosts lost together`` when no
    topology names one); newer incidents win."""
    out: dict[str, str] = {}
    for i in sorted(incidents, key=lambda i: i.detected_at or 0):
        if i.domain or (i.cause == "hosts_lost" and len(i.hosts) > 1):
            for h in i.hosts:
                out[h] = i.domain or "hosts lost together"
    return out


def _aggregate(name: str, kind: str, members: list[Judged]) -> dict[str, Any]:
    ratios = [j.ratio for j in members if j.ratio is not None]
    slowest = max((j.view.steps[-1][1] for j in members if j.view.steps), default=None)
    worst = min(members, key=lambda j: (j.severity, -j.view.phase_elapsed))
    return {
        "group": name, "kind": kind, "ranks": len(members),
        "hosts": len({j.view.host for j in members}),
        "slowest_ratio": max(ratios) if ratios else None,
        "slowest_step": round(slowest, 4) if slowest is not None else None,
        "hung": sum(j.stuck for j in members), "stopped": sum(j.stopped for j in members),
        "lost": sum(j.lost for j in members), "waiting": sum(j.waiting for j in members),
        "worst_phase": worst.view.phase, "worst_elapsed": round(worst.view.phase_elapsed, 1),
        "worst_rank": worst.rank,
    }


def _badness(g: dict[str, Any]) -> tuple[int, float, str]:
    return (-(g["hung"] + g["stopped"] + g["lost"]), -(g["slowest_ratio"] or 0.0), g["group"])


def groups(judged: list[Judged], domains: dict[str, str],
           shown: int = GROUPS_SHOWN) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Aggregates per group, worst first (hung, stopped or lost ranks, then the slowest),
    and the groups past ``shown`` summed into one collapsed line (None if none)."""
    members: dict[tuple[str, str], list[Judged]] = {}
    for j in judged:
        host = j.view.host or "unknown host"
        key = ("domain", domains[host]) if host in domains else ("host", host)
        members.setdefault(key, []).append(j)
    rows = sorted((_aggregate(name, kind, m) for (kind, name), m in members.items()),
                  key=_badness)
    rest = rows[shown:]
    if not rest:
        return rows, None
    collapsed = {k: sum(g[k] for g in rest)
                 for k in ("ranks", "hosts", "hung", "stopped", "lost", "waiting")}
    ratios = [g["slowest_ratio"] for g in rest if g["slowest_ratio"] is not None]
    return rows[:shown], {**collapsed, "groups": len(rest),
                          "slowest_ratio": max(ratios) if ratios else None}


def cell_code(j: Judged) -> str:
    """One character per heat-map cell: S stopped, H hung, L lost, W waiting, ``-`` no
    steps yet, else the ratio's tenth above 1.0 (``0`` at or under 1.0, ``9`` at 1.9+)."""
    if j.stopped:
        return "S"
    if j.stuck:
        return "H"
    if j.lost:
        return "L"
    if j.waiting:
        return "W"
    if j.ratio is None:
        return "-"
    return str(max(0, min(9, round((j.ratio - 1.0) * 10))))


def cell_codes(judged: list[Judged]) -> str:
    """The heat map's cells, in rank order (the caller sorts): 16k ranks are 16 kB."""
    return "".join(cell_code(j) for j in judged)
