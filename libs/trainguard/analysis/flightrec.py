"""Culprits from torch's c10d flight-recorder dumps: which ranks stopped short, per group.

A rank's dump (``TORCH_FR_DUMP_TEMP_FILE<rank>``, or ``torch._C._distributed_c10d.
_dump_fr_trace()``) is a pickled dict: ``version``, ``pg_config`` (group name → desc and
member ranks), ``pg_status`` (the rank's local group id → ``last_enqueued_collective`` /
``last_started_collective`` / ``last_completed_collective``) and ``entries`` (the newest
collectives, each with its group ``(name, desc)``, ``collective_seq_id``, ``is_p2p``,
``profiling_name``). NCCL and gloo (CPU) both record.

Reading: a dump is untrusted input, so :func:`load` unpickles with an Unpickler that admits
no class at all (dicts, lists, tuples, strings and numbers need none) and refuses files over
:data:`MAX_BYTES`. :func:`summarize` turns one dump into a :class:`RankRecord`, small enough
to travel on the bus (the agent publishes these; the diagnoser and ``trainguard fr`` analyse
them).

Analysis (:func:`analyse`): within one group every member runs the same collectives in the
same order, so their sequence numbers are comparable (point-to-point counters are not: those
groups are left out). Rank ``s`` *waits for* member ``r`` when ``s`` has a collective in
flight (enqueued past completed) that ``r`` has not enqueued yet (the CPU side of ``r``
stopped: a hang in Python, a held GIL, a dead process) or that ``r``'s device has not
completed as far as ``s`` (the GPU stopped). The culprits are the ranks at the end of these
waits: the terminal strongly connected components of the wait-for graph, so a rank that is
behind only because it waits on another (a pipeline or tensor-parallel peer of the faulty
rank) is a victim, not a culprit. Members with no dump, or an unreadable one, are waited on
and wait for nobody: they end up culprits whenever someone waits on them. Collectives that
disagree at one sequence number (another op name on some ranks) are reported per group.
"""

from __future__ import annotations

import ast
import io
import json
import os
import pickle
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any, Final

from trainguard.contract.errors import TrainguardError
from trainguard.contract.evidence import Analysis, GroupFinding, GroupStatus, RankRecord

MAX_BYTES: Final = 64 * 1024 * 1024
"""A dump larger than this is refused (2000 entries with stacks are a few MiB)."""
DUMP_PREFIX: Final = "_dump_"
"""torch's default file prefix (``TORCH_FR_DUMP_TEMP_FILE`` defaults to ``/tmp/nccl_trace_rank_``;
the fixtures and trainguard's launcher use names ending in the rank)."""


__all__ = ["Analysis", "DumpError", "GroupFinding", "GroupStatus", "RankRecord", "analyse",
           "load", "loads", "read_dir", "render", "summarize"]


class DumpError(TrainguardError):
    """A dump that cannot be read (not a flight-recorder dump, too large, a class in it)."""


class _NoClasses(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise DumpError(f"refusing {module}.{name} in a flight-recorder dump (only plain "
                        "containers, strings and numbers are allowed)")


def loads(raw: bytes) -> dict[str, Any]:
    """A dump's bytes (pickle, or torch's JSON variant) as a plain dict."""
    if len(raw) > MAX_BYTES:
        raise DumpError(f"dump of {len(raw)} bytes exceeds {MAX_BYTES}")
    try:
        value = json.loads(raw) if raw[:1] in (b"{", b"[") \
            else _NoClasses(io.BytesIO(raw)).load()
    except DumpError:
        raise
    except Exception as exc:
        raise DumpError(f"not a flight-recorder dump: {type(exc).__name__}: {exc}") from None
    if not isinstance(value, dict) or ("pg_status" not in value and "entries" not in value):
        raise DumpError("not a flight-recorder dump: no pg_status or entries")
    return value


def load(path: str) -> dict[str, Any]:
    size = os.path.getsize(path)
    if size > MAX_BYTES:
        raise DumpError(f"{path}: {size} bytes exceeds {MAX_BYTES}")
    with open(path, "rb") as f:
        try:
            return loads(f.read())
        except DumpError as exc:
            raise DumpError(f"{path}: {exc}") from None


_TRAILING_INT = re.compile(r"(\d+)(?:\.\w+)?$")


def rank_of(path: str) -> int | None:
    """The rank a dump file is named after (torch appends it to the prefix)."""
    m = _TRAILING_INT.search(os.path.basename(path))
    return int(m.group(1)) if m else None


def _order(name: str) -> tuple[int, int, str]:
    return (0, int(name), "") if name.isdigit() else (1, 0, name)


def _members(text: object) -> list[int]:
    try:
        value = ast.literal_eval(text) if isinstance(text, str) else text
        return sorted(int(r) for r in value) if isinstance(value, list | tuple) else []
    except (ValueError, SyntaxError, TypeError):
        return []


def _int(value: object, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _names(status: Mapping[str, Any], config: Mapping[str, Any],
           anchors: Mapping[str, str]) -> dict[str, str]:
    """Local group id → group name. Entries name the groups they ran on; the rest follow
    from the order both are created in (ids and names rise together), when that order
    agrees with every entry; else a group keeps its local id as its name (gloo: the same
    on every rank that built the same groups)."""
    names = [n for n in config if n]
    ids = sorted(status, key=_order)
    zipped = dict(zip(ids, sorted(names, key=_order), strict=False)) \
        if len(ids) == len(names) else {}
    if zipped and any(zipped.get(k) != v for k, v in anchors.items()):
        zipped = {}
    return {pid: anchors.get(pid) or zipped.get(pid) or pid for pid in ids}


def summarize(dump: Mapping[str, Any], rank: int, source: str = "") -> RankRecord:
    """One rank's dump as a :class:`RankRecord`."""
    config = dump.get("pg_config") or {}
    config = config if isinstance(config, dict) else {}
    status = dump.get("pg_status") or {}
    status = status if isinstance(status, dict) else {}
    raw_entries = dump.get("entries") or []
    entries = [e for e in raw_entries if isinstance(e, dict)] \
        if isinstance(raw_entries, list) else []
    anchors: dict[str, str] = {}
    descs: dict[str, str] = {}
    p2p: set[str] = set()
    for e in entries:
        pg = e.get("process_group")
        if isinstance(pg, list | tuple) and pg:
            anchors.setdefault(str(e.get("pg_id")), str(pg[0]))
            if len(pg) > 1:
                descs.setdefault(str(pg[0]), str(pg[1]))
            if e.get("is_p2p"):
                p2p.add(str(pg[0]))
    names = _names({str(k): v for k, v in status.items()}, config, anchors)
    groups: dict[str, GroupStatus] = {}
    for pid, st in status.items():
        if not isinstance(st, dict):
            continue
        name = names[str(pid)]
        found = config.get(name)
        cfg: dict[str, Any] = found if isinstance(found, dict) else {}
        completed = max(0, _int(st.get("last_completed_collective")))
        groups[name] = GroupStatus(
            name=name, desc=str(cfg.get("desc") or descs.get(name, "")),
            ranks=_members(cfg.get("ranks")),
            enqueued=max(0, _int(st.get("last_enqueued_collective"))), completed=completed,
            p2p=name in p2p, frontier=_frontier(entries, name, completed + 1))
    return RankRecord(rank=rank, source=source, version=str(dump.get("version", "")),
                      entries=len(entries), groups=groups)


def _frontier(entries: list[dict[str, Any]], group: str, seq: int) -> str:
    for e in entries:
        pg = e.get("process_group")
        if isinstance(pg, list | tuple) and pg and str(pg[0]) == group \
                and not e.get("is_p2p") and e.get("collective_seq_id") == seq:
            return str(e.get("profiling_name", ""))
    return ""


def read_dir(path: str, prefix: str = "") -> list[RankRecord]:
    """Every dump in a directory (files named ``<prefix><rank>``), one record per rank;
    an unreadable dump becomes a record with ``error`` set."""
    records: dict[int, RankRecord] = {}
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if not os.path.isfile(full) or (prefix and not name.startswith(prefix)):
            continue
        rank = rank_of(name)
        if rank is None or (not prefix and not _looks_like_dump(full)):
            continue
        try:
            records[rank] = summarize(load(full), rank, full)
        except (DumpError, OSError) as exc:
            records[rank] = RankRecord(rank=rank, source=full, error=str(exc))
    return [records[r] for r in sorted(records)]


def _looks_like_dump(path: str) -> bool:
    """A pickle (protocol 2+) or JSON object: skip logs and notes beside the dumps."""
    with open(path, "rb") as f:
        head = f.read(1)
    return head in (b"\x80", b"{")


# -- analysis ------------------------------------------------------------------------------


class _Group:
    def __init__(self, name: str) -> None:
        self.name = name
        self.desc = ""
        self.members: set[int] = set()
        self.seen: dict[int, GroupStatus] = {}
        self.p2p = False


def _groups(records: list[RankRecord], expected: set[int],
            scope: set[int] | None) -> dict[str, _Group]:
    groups: dict[str, _Group] = {}
    for rec in records:
        for name, st in rec.groups.items():
            g = groups.setdefault(name, _Group(name))
            g.desc = g.desc or st.desc
            g.members |= set(st.ranks) or {rec.rank}
            g.seen[rec.rank] = st
            g.p2p = g.p2p or st.p2p
    for g in groups.values():
        if g.desc == "default_pg" or (g.name == "0" and not any(s.ranks
                                                               for s in g.seen.values())):
            g.members |= expected
        if scope is not None:
            g.members &= scope | set(g.seen)
    return groups


def analyse(records: Iterable[RankRecord], expected: Iterable[int] = (),
            scope: Iterable[int] | None = None) -> Analysis:
    """The culprits of a hang from the dumps of its ranks (the module docstring says how).

    ``expected``: ranks that should have dumped (the world), beyond those the groups list.
    ``scope``: when only some ranks were asked (one host's), group members outside it are
    left out: not asked is not missing.
    """
    recs = sorted(records, key=lambda r: r.rank)
    readable = [r for r in recs if not r.error]
    unreadable = {str(r.rank): r.error for r in recs if r.error}
    scoped = None if scope is None else set(scope) | set(expected)
    groups = _groups(readable, set(expected), scoped)
    known = {r.rank for r in readable}
    everyone = set(expected) | {m for g in groups.values() for m in g.members} \
        | {r.rank for r in recs} | (scoped or set())
    missing = sorted(everyone - known - {r.rank for r in recs if r.error})
    waits: dict[int, set[int]] = defaultdict(set)
    findings: list[GroupFinding] = []
    skipped = sorted((g.name for g in groups.values() if g.p2p), key=_order)
    for g in sorted(groups.values(), key=lambda g: _order(g.name)):
        if g.p2p or len(g.members) < 2:
            continue
        finding = _compare(g, waits)
        if finding is not None:
            findings.append(finding)
    culprits = _terminal(waits)
    most = max((r.entries for r in readable), default=0)
    empty = sorted(r.rank for r in readable if r.entries == 0 and most > 0)
    findings.sort(key=lambda f: (not set(f.behind) & set(culprits), _order(f.group)))
    return Analysis(culprits=culprits, groups=findings, ranks=sorted(known), missing=missing,
                    empty=empty, unreadable=unreadable, skipped_p2p=skipped)


def _compare(g: _Group, waits: dict[int, set[int]]) -> GroupFinding | None:
    behind: dict[int, str] = {}
    missing = sorted(g.members - set(g.seen))
    for s, st in g.seen.items():
        if st.enqueued <= st.completed:
            continue  # nothing in flight: s waits for nobody here
        nxt = st.completed + 1
        for r in sorted(g.members - {s}):
            other = g.seen.get(r)
            if other is None:
                why = "no dump"
            elif other.enqueued < nxt:
                why = f"enqueued {other.enqueued}, peers wait in {nxt}"
            elif other.completed < st.completed:
                why = f"completed {other.completed}, peers completed {st.completed}"
            else:
                continue
            waits[s].add(r)
            behind.setdefault(r, why)
    mismatched = _mismatched(g)
    if not behind and not mismatched and not missing:
        return None
    return GroupFinding(group=g.name, desc=g.desc, ranks=sorted(g.members),
                        behind=sorted(behind), why={str(r): w for r, w in behind.items()},
                        missing=missing, mismatched=mismatched)


def _mismatched(g: _Group) -> list[int]:
    """Ranks at the same next collective as others but with another op name (minority)."""
    at: dict[int, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for r, st in g.seen.items():
        if st.frontier and st.enqueued > st.completed:
            at[st.completed + 1][st.frontier].append(r)
    odd: list[int] = []
    for ops in at.values():
        if len(ops) > 1:
            top = max(ops.values(), key=len)
            odd.extend(r for rs in ops.values() if rs is not top for r in rs)
    return sorted(odd)


def _terminal(waits: Mapping[int, set[int]]) -> list[int]:
    """Ranks in the terminal strongly connected components of the wait-for graph (those
    waited on that wait, directly or not, only for each other)."""
    nodes = sorted(set(waits) | {r for rs in waits.values() for r in rs})
    reach: dict[int, set[int]] = {}
    for n in nodes:
        seen: set[int] = set()
        stack = [n]
        while stack:
            for m in waits.get(stack.pop(), ()):
                if m not in seen:
                    seen.add(m)
                    stack.append(m)
        reach[n] = seen
    waited = {r for rs in waits.values() for r in rs}
    return [n for n in nodes if n in waited and all(n in reach[m] for m in reach[n])]


def render(a: Analysis) -> str:
    """The analysis as the text ``trainguard fr`` prints."""
    lines = [f"culprit ranks: {', '.join(map(str, a.culprits)) or 'none found'}"]
    if a.culprits:
        lines.append(f"culprit groups: {', '.join(a.culprit_groups()) or '-'}")
    lines.append(f"dumps read: {len(a.ranks)}"
                 + (f"; missing: {a.missing}" if a.missing else "")
                 + (f"; empty: {a.empty}" if a.empty else "")
                 + (f"; unreadable: {sorted(map(int, a.unreadable))}" if a.unreadable else ""))
    for g in a.groups:
        label = f"group {g.group}" + (f" ({g.desc})" if g.desc else "")
        lines.append(f"  {label} ranks {g.ranks}")
        for r in g.behind:
            mark = " <- culprit" if r in a.culprits else ""
            lines.append(f"    rank {r}: {g.why.get(str(r), '')}{mark}")
        if g.mismatched:
            lines.append(f"    mismatched collective on ranks {g.mismatched}")
    if a.skipped_p2p:
        lines.append(f"point-to-point groups not compared: {', '.join(a.skipped_p2p)}")
    for key, why in sorted(a.unreadable.items(), key=lambda kv: int(kv[0])):
        lines.append(f"  rank {key}: {why}")
    return "\n".join(lines)
