"""The exit-text knowledge (``error-signatures.toml``) loaded, checked and matched.

:func:`match` reads a worker's last words (its stderr tail and the agent's error line) and
returns the strongest :class:`Match`: a signature of the data file, an Xid whose meaning
comes from NVIDIA's catalog (:mod:`trainguard.runtime.xids`), or nothing. :func:`killed` is the
fallback for a process killed by SIGKILL with no text. :func:`watchdog_progress` reads the
``last enqueued / last completed NCCL work`` numbers NCCL's watchdog prints, and
:func:`behind` names the ranks those numbers say are behind their group.

The data file is read once, on first use; a mistake in it (an unknown key, a cause outside
the contract's vocabulary, a pattern that does not compile) raises :class:`SignatureError`
naming the entry and the fix.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import re
import tomllib
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, get_args

import msgspec

from trainguard.contract.errors import TrainguardError
from trainguard.contract.schemas import Cause
from trainguard.runtime import xids

DATA: Final = "error-signatures.toml"


class SignatureError(TrainguardError):
    """The signature data file is wrong (the message names the entry and the fix)."""


class SignatureSpec(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    cause: Cause
    weight: float
    fact: str
    patterns: list[str]
    peer: bool = False


class XidSpec(msgspec.Struct, forbid_unknown_fields=True):
    pattern: str
    fatal_weight: float
    restart_weight: float
    ignore_weight: float


class SigkillSpec(msgspec.Struct, forbid_unknown_fields=True):
    cause: Cause
    weight: float
    fact: str
    exit_codes: list[int]


class DataFile(msgspec.Struct, forbid_unknown_fields=True):
    xid: XidSpec
    sigkill: SigkillSpec
    signature: list[SignatureSpec]


@dataclass(frozen=True)
class Signature:
    spec: SignatureSpec
    regex: re.Pattern[str]


@dataclass(frozen=True)
class Knowledge:
    signatures: tuple[Signature, ...]
    xid: XidSpec
    xid_regex: re.Pattern[str]
    sigkill: SigkillSpec
    peer: re.Pattern[str]


@dataclass(frozen=True)
class Match:
    """What a text says: the cause, how sure, the fact to show and the words that said it."""

    name: str
    cause: Cause
    weight: float
    fact: str
    matched: str
    peer: bool = False
    recommended: tuple[str, ...] | None = None
    """Actions that replace the cause's defaults (an Xid's own, from the catalog)."""


def _compile(where: str, patterns: Iterable[str]) -> re.Pattern[str]:
    try:
        return re.compile("|".join(f"(?:{p})" for p in patterns), re.IGNORECASE)
    except re.error as exc:
        raise SignatureError(f"{DATA}: {where}: bad regular expression ({exc}); fix the "
                             "pattern (TOML literal strings, '...', keep backslashes)") from None


def parse(text: str) -> Knowledge:
    """The data file's text, checked and compiled."""
    try:
        data = msgspec.convert(tomllib.loads(text), DataFile)
    except (tomllib.TOMLDecodeError, msgspec.ValidationError) as exc:
        raise SignatureError(f"{DATA}: {exc} (keys: name, cause, weight, fact, patterns, "
                             "peer; causes from trainguard.contract.schemas.Cause)") from None
    sigs = []
    seen: set[str] = set()
    for i, spec in enumerate(data.signature):
        where = f"signature {spec.name!r} (entry {i + 1})"
        if spec.name in seen:
            raise SignatureError(f"{DATA}: {where}: duplicate name; names must be unique")
        if not spec.patterns:
            raise SignatureError(f"{DATA}: {where}: no patterns; give at least one")
        if not 0.0 < spec.weight <= 1.0:
            raise SignatureError(f"{DATA}: {where}: weight {spec.weight} must be in (0, 1]")
        seen.add(spec.name)
        sigs.append(Signature(spec, _compile(where, spec.patterns)))
    peers = [p for s in data.signature if s.peer for p in s.patterns]
    return Knowledge(signatures=tuple(sigs), xid=data.xid,
                     xid_regex=_compile("[xid] pattern", [data.xid.pattern]),
                     sigkill=data.sigkill, peer=_compile("peer patterns", peers))


@functools.cache
def knowledge() -> Knowledge:
    text = importlib.resources.files(__package__ or "").joinpath(DATA).read_text("utf-8")
    return parse(text)


def _xid_match(text: str, k: Knowledge) -> Match | None:
    best: Match | None = None
    for m in k.xid_regex.finditer(text):
        code = int(m.group(1))
        x = xids.lookup(code)
        if x is None:
            continue
        recommended = xid_actions(x)
        weight = k.xid.fatal_weight if x.fatal else \
            k.xid.ignore_weight if x.action == "IGNORE" else k.xid.restart_weight
        found = Match(name=f"xid_{code}", cause=x.cause, weight=weight,
                      fact=f"XID {code} ({x.mnemonic}: {x.meaning}); NVIDIA's action "
                           f"{x.action or 'none'}", matched=m.group(0),
                      recommended=recommended)
        if best is None or found.weight > best.weight:
            best = found
    return best


def match(text: str, k: Knowledge | None = None) -> Match | None:
    """The strongest signature (or Xid) in ``text``; None when nothing is known of it."""
    k = k or knowledge()
    xid = best = _xid_match(text, k)
    for sig in k.signatures:
        if best is not None and sig.spec.weight <= best.weight:
            continue
        m = sig.regex.search(text)
        if m:
            s = sig.spec
            best = Match(name=s.name, cause=s.cause, weight=s.weight, fact=s.fact,
                         matched=m.group(0), peer=s.peer)
    if xid is not None and best is not None and best is not xid and best.cause == xid.cause:
        # Text and Xid agree on the cause: NVIDIA's action for the Xid decides what to do
        # (a row remapped, Xid 63, is noted, not a reason to take the GPU away).
        best = dataclasses.replace(best, recommended=xid.recommended,
                                   fact=f"{best.fact}; {xid.fact}")
    return best


def killed(exit_code: int | None, signal: str | None) -> Match | None:
    """The SIGKILL fallback: a worker killed with no text that says why."""
    k = knowledge().sigkill
    if signal == "SIGKILL" or exit_code in k.exit_codes:
        return Match(name="sigkill", cause=k.cause, weight=k.weight, fact=k.fact,
                     matched=f"exit {exit_code}" + (f" ({signal})" if signal else ""))
    return None


# -- NCCL's watchdog numbers -------------------------------------------------------------

_PROGRESS = re.compile(
    r"\[(?:PG (?:ID )?(?P<pg>\d+)[^\]]*?)?Rank (?P<rank>\d+)\][^\n]*?"
    r"last enqueued (?:NCCL )?work: (?P<enq>-?\d+), last completed (?:NCCL )?work: "
    r"(?P<done>-?\d+)", re.IGNORECASE)


@dataclass(frozen=True)
class WatchdogProgress:
    rank: int
    pg: str
    enqueued: int
    completed: int


def watchdog_progress(text: str) -> list[WatchdogProgress]:
    """Every ``[PG p Rank r] ... last enqueued NCCL work: E, last completed NCCL work: C``."""
    return [WatchdogProgress(int(m.group("rank")), m.group("pg") or "0", int(m.group("enq")),
                     int(m.group("done"))) for m in _PROGRESS.finditer(text)]


def behind(progress: Iterable[WatchdogProgress]) -> dict[int, str]:
    """Ranks whose numbers trail their process group's: the lowest enqueued where the
    group's differ (that rank stopped issuing collectives), else the lowest completed (its
    device stopped); rank → the reason. Empty when all agree or one rank alone reported."""
    by_pg: dict[str, dict[int, WatchdogProgress]] = defaultdict(dict)
    for p in progress:
        by_pg[p.pg][p.rank] = p
    found: dict[int, str] = {}
    for pg, ranks in by_pg.items():
        if len(ranks) < 2:
            continue
        enq = {p.enqueued for p in ranks.values()}
        done = {p.completed for p in ranks.values()}
        if len(enq) > 1:
            low = min(enq)
            for r, p in ranks.items():
                if p.enqueued == low:
                    found.setdefault(r, f"PG {pg}: last enqueued {low}, peers up to {max(enq)}")
        elif len(done) > 1:
            low = min(done)
            for r, p in ranks.items():
                if p.completed == low:
                    found.setdefault(r, f"PG {pg}: last completed {low}, "
                                        f"peers up to {max(done)}")
    return dict(sorted(found.items()))


WATCHDOG: Final = frozenset({"nccl_watchdog", "nccl_heartbeat"})
"""Signatures whose texts carry the watchdog's sequence numbers."""


def xid_actions(x: xids.Xid) -> tuple[str, ...] | None:
    """NVIDIA's action as the remediator's: IGNORE → only tell (alert); restarting the
    application is enough → restart; anything more (RESET_GPU, RESTART_BM, the NVLink and
    ECC workflows) → None, the cause's default (gpu_lost/hbm_ecc: the GPU or its node
    goes)."""
    if x.fatal:
        return None
    return ("alert",) if x.action == "IGNORE" else ("restart",)


CAUSES: Final = frozenset(get_args(Cause))
