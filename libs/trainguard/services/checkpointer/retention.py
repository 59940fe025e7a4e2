"""Which checkpoints retention lets go.

Keep the newest ``keep`` committed, non-suspect checkpoints, the resume pointer and the
pinned one (a rollback target); suspect checkpoints newer than the oldest kept one stay
too, as evidence; and the base of every incremental checkpoint that stays (a restore of it
reads its base). Everything else that is committed may go. Pending and failed records are
never candidates: an uncommitted checkpoint may still be being written, and deleting its
files would be deleting something nobody has judged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    step: int
    status: str
    suspect: bool
    retained: bool = True
    base: int | None = None
    """An incremental checkpoint's base step; None: a full one."""


def expire(entries: Sequence[Entry], keep: int, *, pointer: int | None = None,
           pin: int | None = None, include_expired: bool = False) -> list[int]:
    """Steps to let go, newest first. ``include_expired`` also lists committed checkpoints
    already expired (when their files are now to be deleted)."""
    ordered = sorted(entries, key=lambda e: e.step, reverse=True)
    good = [e.step for e in ordered if e.status == "committed" and not e.suspect]
    kept = set(good[:max(1, keep)])
    oldest_kept = min(kept) if kept else None
    protected = kept | {s for s in (pointer, pin) if s is not None}
    out = []
    for e in ordered:
        if e.status != "committed" or e.step in protected:
            continue
        if e.suspect and oldest_kept is not None and e.step > oldest_kept:
            continue
        if not e.retained and not include_expired:
            continue
        if oldest_kept is None and e.suspect:
            continue  # nothing good to fall back on: keep the evidence
        out.append(e.step)
    needed = {e.base for e in ordered
              if e.base is not None and e.status == "committed" and e.step not in out}
    return [s for s in out if s not in needed]
