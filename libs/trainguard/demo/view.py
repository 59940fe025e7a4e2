"""The demo's live terminal view and its closing summary (rich)."""

from __future__ import annotations

import time

from rich.console import Group
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from .cluster import Observer
from .runner import Outcome


def live(obs: Observer, title: str, lines: int = 14) -> Group:
    ranks = Table("rank", "host", "step", "phase", "step ms", "attempt", "seen",
                  title=title, expand=False)
    now = time.time()
    for rank in sorted(obs.ranks):
        r = obs.ranks[rank]
        age = now - r.last_seen
        ranks.add_row(str(rank), r.host, str(r.step), r.phase or "-",
                      f"{(r.step_time or 0) * 1000:.0f}", str(r.attempt),
                      f"[red]{age:.0f}s ago[/]" if age > 3 else "now")
    events = "\n".join(time.strftime("%H:%M:%S ", time.localtime(t)) + text
                       for t, text in obs.timeline[-lines:]) or "(no events yet)"
    return Group(ranks, Panel(Text(events), title="incident timeline"))  # text, not markup


def summary(outcomes: list[Outcome], goodput: float, how: str = "") -> Table:
    lost = sum(o.steps_lost or 0 for o in outcomes)
    title = f"trainguard demo{f' ({how})' if how else ''}: goodput {goodput:.0%}, " \
            f"{lost} steps lost in {len(outcomes)} faults"
    table = Table("fault", "injected at step", "detected after", "cause", "actions",
                  "training back after", "steps lost", "verdict", title=title)
    for o in outcomes:
        table.add_row(o.fault.name, str(o.injected_step), o.seconds(o.detected_at),
                      o.cause or "-", " ".join(o.actions) or "-", o.seconds(o.recovered_at),
                      "-" if o.steps_lost is None else str(o.steps_lost),
                      "[green]ok[/]" if o.ok else f"[red]{escape('; '.join(o.problems))}[/]")
    return table
