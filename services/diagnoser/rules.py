"""Diagnosis rules: pure, synchronous, no I/O.

:class:`Diagnoser` keeps short per-job windows of worker exits and per-host windows of GPU
samples, and turns each anomaly into a :class:`Decision`: a new diagnosis, an update of an
open one (a symptom joining its root), or a new root that supersedes an earlier guess.
One failure produces one diagnosis: a GPU drop that crashes one rank and hangs the others
is named once, by its root, with every symptom's anomaly id attached.
"""

from __future__ import annotations

import collections
import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

from trainguard.envelope import uuid7
from trainguard.schemas import Anomaly, Cause, Diagnosis, EvidenceItem, GpuSample, WorkerExit

from .knowledge import (
    EXIT_PATTERNS,
    HOT_C,
    PEER_ERROR,
    POWER_REASONS,
    RECOMMENDED,
    THERMAL_REASONS,
    TRACEBACK,
    XIDS,
)

ROOT_CAUSES: frozenset[Cause] = frozenset({"gpu_lost", "hbm_ecc", "oom", "process_crash",
                                           "sdc_suspect", "numeric"})
SYMPTOM_KINDS = frozenset({"hang", "unresponsive", "crash", "throughput_drop"})
SYMPTOM_CAUSES: frozenset[Cause] = frozenset({"network", "rank_hang", "unknown"})
"""Causes that are often a guess made from a symptom before the root shows up."""


@dataclass
class Verdict:
    cause: Cause
    confidence: float
    ranks: list[int]
    hosts: list[str]
    facts: list[EvidenceItem]
    collateral: bool = False
    """The anomaly is a consequence of another rank's failure (a peer error)."""
    signature: str = ""


@dataclass
class Open:
    diagnosis: Diagnosis
    at: float
    root: bool
    last: float = 0.0

    def __post_init__(self) -> None:
        self.last = self.last or self.at


@dataclass
class Decision:
    publish: list[Diagnosis] = field(default_factory=list)


@dataclass
class HostRecord:
    """What Redis remembers of a host's past diagnoses."""

    counts: dict[str, int] = field(default_factory=dict)


class Diagnoser:
    def __init__(self, *, window: float = 60.0, gpu_window: float = 120.0,
                 same_cause_window: float = 10.0, symptom_window: float = 20.0) -> None:
        self.window = window
        self.symptom_window = symptom_window
        """A hang or silence joins a root failure this soon after it (a crash's peers hang
        within a hang limit); later it is a failure of its own."""
        self.same_cause_window = same_cause_window
        """A new anomaly of the same cause joins an open diagnosis only this soon after its
        last anomaly: later, it is a new failure (the last one was dealt with)."""
        self.gpu_window = gpu_window
        self.exits: dict[str, collections.deque[WorkerExit]] = collections.defaultdict(
            lambda: collections.deque(maxlen=512))
        self.gpu: dict[str, collections.deque[GpuSample]] = collections.defaultdict(
            lambda: collections.deque(maxlen=64))
        self.open: dict[str, list[Open]] = collections.defaultdict(list)

    # -- observations ---------------------------------------------------------------------
    def observe_exit(self, ex: WorkerExit) -> None:
        self.exits[ex.job].append(ex)

    def observe_gpu(self, sample: GpuSample) -> None:
        self.gpu[sample.host].append(sample)

    # -- decisions ------------------------------------------------------------------------
    def on_anomaly(self, a: Anomaly, now: float,
                   history: dict[str, HostRecord] | None = None) -> Decision:
        if a.status == "resolved":
            return Decision()
        history = history or {}
        v = self.classify(a, now)
        self._expire(a.job, now)
        opened = self.open[a.job]
        for o in opened:
            if a.id in o.diagnosis.anomaly_ids:
                return Decision()  # a redelivered anomaly
        for o in opened:
            if self._joins(v, a, o, now):
                d = o.diagnosis
                o.last = now
                d.anomaly_ids.append(a.id)
                d.ranks = sorted(set(d.ranks) | (set(v.ranks) if not v.collateral else set()))
                d.evidence.append(EvidenceItem(fact=f"{a.kind} on ranks {a.ranks} follows from "
                                               "this failure", source=f"anomaly:{a.id}"))
                d.rev += 1
                return Decision([d])
        diagnosis = self._diagnosis(a, v, now, history)
        decision = Decision([diagnosis])
        for o in opened:
            od = o.diagnosis
            overlap = bool(set(v.ranks) & set(od.ranks) or set(v.hosts) & set(od.hosts))
            recent = now - o.last <= 3 * self.same_cause_window
            # A root explains a recent symptom-like guess; any cause beats "unknown" on the
            # same ranks.
            explains = v.cause in ROOT_CAUSES and not v.collateral and recent \
                and od.cause in SYMPTOM_CAUSES
            guess = od.cause == "unknown" and v.cause != "unknown" and overlap and recent
            if (explains or guess) and not o.root and od.status == "open":
                # An earlier guess (a hang, a peer error) was a symptom of this root.
                od.status = "superseded"
                od.superseded_by = diagnosis.id
                od.rev += 1
                diagnosis.anomaly_ids.extend(x for x in od.anomaly_ids
                                             if x not in diagnosis.anomaly_ids)
                decision.publish.insert(0, od)
        opened.append(Open(diagnosis, now, root=v.cause in ROOT_CAUSES and not v.collateral))
        return decision

    def _expire(self, job: str, now: float) -> None:
        self.open[job] = [o for o in self.open[job] if now - o.at <= self.window]

    def _joins(self, v: Verdict, a: Anomaly, o: Open, now: float) -> bool:
        d = o.diagnosis
        if d.status != "open":
            return False
        if v.collateral or (o.root and a.kind in SYMPTOM_KINDS and v.cause not in ROOT_CAUSES
                            and now - o.last <= self.symptom_window):
            return True  # a symptom of an open root failure
        return v.cause == d.cause and now - o.last <= self.same_cause_window \
            and (not d.hosts or bool(set(v.hosts) & set(d.hosts)))

    def _diagnosis(self, a: Anomaly, v: Verdict, now: float,
                   history: dict[str, HostRecord]) -> Diagnosis:
        confidence = v.confidence
        recommended = list(RECOMMENDED[v.cause])
        for host in v.hosts:
            seen = history.get(host, HostRecord()).counts.get(v.cause, 0)
            if seen:
                confidence = min(0.99, confidence + 0.1 * seen)
                v.facts.append(EvidenceItem(fact=f"{host} had {seen} earlier {v.cause} "
                                            "diagnosis(es)", source="redis:host_history",
                                            value=seen))
                if v.cause in ("network", "oom", "process_crash") and "isolate" not in \
                        recommended and seen >= 1:
                    recommended = ["isolate", *recommended] if v.cause == "network" \
                        else [*recommended, "escalate"]
        if v.signature:
            v.facts.append(EvidenceItem(fact="traceback signature", source="exit",
                                        value=v.signature))
        return Diagnosis(id=uuid7(), job=a.job, anomaly_ids=[a.id], cause=v.cause,
                         confidence=round(confidence, 3), ranks=v.ranks, hosts=v.hosts,
                         evidence=v.facts, recommended=recommended,
                         summary=summarize(a, v, recommended), onset_at=a.onset_at,
                         step=a.step, time=now)

    # -- classification -------------------------------------------------------------------
    def classify(self, a: Anomaly, now: float) -> Verdict:
        ev = a.evidence
        facts = [EvidenceItem(fact=f"{a.kind} anomaly on ranks {a.ranks}", source="detector",
                              value=a.id)]
        hw = self._gpu_findings(a.hosts, now)
        match a.kind:
            case "crash":
                return self._crash(a, facts, hw, now)
            case "gpu_health":
                return self._gpu_health(a, facts, hw)
            case "hang":
                culprits = [int(r) for r in ev.get("culprits", [])]
                basis = str(ev.get("culprit_basis", ""))
                if hw and (hw[0][0] in ("gpu_lost", "hbm_ecc")):
                    return Verdict(hw[0][0], 0.85, a.ranks, a.hosts, [*facts, hw[0][1]])
                if culprits:
                    phases = ev.get("phases", {})
                    where = {r: (phases.get(str(r)) or {}).get("phase") for r in culprits}
                    facts.append(EvidenceItem(fact=f"ranks {culprits} stuck outside the "
                                              f"collective ({basis})", source="detector",
                                              value=where))
                    conf = 0.9 if basis == "process_state" else 0.8
                    return Verdict("rank_hang", conf, culprits, _hosts_of(a, culprits), facts)
                majority = str(ev.get("majority_phase", ""))
                if majority == "comm":
                    facts.append(EvidenceItem(fact="every rank waits in the collective",
                                              source="detector", value=ev.get("phase_counts")))
                    return Verdict("network", 0.7, a.ranks, a.hosts, facts)
                if majority == "data":
                    return Verdict("data_pipeline", 0.6, a.ranks, a.hosts, facts)
                return Verdict("unknown", 0.3, a.ranks, a.hosts, facts)
            case "unresponsive":
                if hw:
                    return Verdict(hw[0][0], 0.8, a.ranks, a.hosts, [*facts, hw[0][1]])
                facts.append(EvidenceItem(fact="heartbeats stopped with no exit reported",
                                          source="detector"))
                return Verdict("unknown", 0.3, a.ranks, a.hosts, facts)
            case "nonfinite":
                if ev.get("minority"):
                    facts.append(EvidenceItem(fact="only a minority of data-parallel ranks saw "
                                              "NaN/Inf before the all-reduce", source="detector",
                                              value=ev.get("nonfinite_ranks")))
                    return Verdict("sdc_suspect", 0.7, a.ranks, a.hosts, facts)
                facts.append(EvidenceItem(fact="NaN/Inf on every rank", source="detector",
                                          value=ev.get("loss")))
                return Verdict("numeric", 0.85, a.ranks, a.hosts, facts)
            case "grad_explosion" | "grad_vanishing" | "loss_spike":
                return Verdict("numeric", 0.6, a.ranks, a.hosts, facts)
            case "sdc_mismatch":
                tie = bool(ev.get("tie"))
                facts.append(EvidenceItem(fact="replica fingerprints disagree at one step",
                                          source="detector", value=ev.get("suspects")))
                return Verdict("sdc_suspect", 0.5 if tie else 0.85, a.ranks, a.hosts, facts)
            case "straggler":
                return self._straggler(a, facts, now)
            case "data_stall":
                return Verdict("data_pipeline", 0.8, a.ranks, a.hosts, facts)
            case "throughput_drop":
                return Verdict("unknown", 0.3, a.ranks, a.hosts, facts)
            case "checkpoint_slow":
                return Verdict("storage_io", 0.8, a.ranks, a.hosts, facts)
        return Verdict("unknown", 0.2, a.ranks, a.hosts, facts)

    def _crash(self, a: Anomaly, facts: list[EvidenceItem],
               hw: list[tuple[Cause, EvidenceItem]], now: float) -> Verdict:
        ev = a.evidence
        text = f"{ev.get('error') or ''}\n{ev.get('stderr_tail') or ''}"
        root = self._root_exit(a.job, now)
        if PEER_ERROR.search(text) and root is not None and root.rank not in a.ranks:
            facts.append(EvidenceItem(fact=f"peer error after rank {root.rank} on {root.host} "
                                      "exited first", source="exit", value=root.id))
            return Verdict("network", 0.5, [root.rank], [root.host], facts, collateral=True)
        if hw:
            cause, item = hw[0]
            return Verdict(cause, 0.95, a.ranks, a.hosts, [*facts, item])
        best = None
        for pattern in EXIT_PATTERNS:
            m = pattern.regex.search(text)
            if m and (best is None or pattern.weight > best[0].weight):
                best = (pattern, m.group(0))
        signature = traceback_signature(text)
        if best is not None:
            pattern, matched = best
            facts.append(EvidenceItem(fact=pattern.fact, source="exit", value=matched))
            return Verdict(pattern.cause, pattern.weight, a.ranks, a.hosts, facts,
                           signature=signature)
        sig = ev.get("signal")
        if TRACEBACK.search(text) or sig or ev.get("exit_code"):
            facts.append(EvidenceItem(
                fact=f"exited with code {ev.get('exit_code')}"
                     f"{' (' + str(sig) + ')' if sig else ''}, no hardware or OOM evidence",
                source="exit", value=last_line(text)))
            return Verdict("process_crash", 0.75 if TRACEBACK.search(text) else 0.6, a.ranks,
                           a.hosts, facts, signature=signature)
        return Verdict("unknown", 0.3, a.ranks, a.hosts, facts)

    def _gpu_health(self, a: Anomaly, facts: list[EvidenceItem],
                    hw: list[tuple[Cause, EvidenceItem]]) -> Verdict:
        ev = a.evidence
        for x in ev.get("xids", []):
            code = int(x.get("code", 0)) if isinstance(x, dict) else int(x)
            xid = XIDS.get(code)
            if xid is not None:
                facts.append(EvidenceItem(fact=f"XID {code}: {xid.meaning}", source="nvml",
                                          value=code))
                return Verdict(xid.cause, 0.95 if xid.fatal else 0.7, a.ranks, a.hosts, facts)
        if any(k.startswith("ecc_uncorrected") for k in ev):
            facts.append(EvidenceItem(fact="uncorrectable ECC count rising", source="nvml",
                                      value={k: v for k, v in ev.items() if k.startswith("ecc")}))
            return Verdict("hbm_ecc", 0.9, a.ranks, a.hosts, facts)
        if hw:
            return Verdict(hw[0][0], 0.8, a.ranks, a.hosts, [*facts, hw[0][1]])
        return Verdict("unknown", 0.3, a.ranks, a.hosts, facts)

    def _straggler(self, a: Anomaly, facts: list[EvidenceItem], now: float) -> Verdict:
        for host in a.hosts:
            for sample in reversed(self.gpu.get(host, ())):
                if now - sample.time > self.gpu_window:
                    break
                for g in sample.gpus:
                    reasons = set(g.throttle_reasons)
                    if reasons & THERMAL_REASONS or (g.temperature_c or 0) >= HOT_C:
                        facts.append(EvidenceItem(
                            fact=f"GPU {g.index} on {host} thermally throttled "
                                 f"({', '.join(sorted(reasons)) or 'hot'}, "
                                 f"{g.temperature_c} C)", source="nvml", value=sorted(reasons)))
                        return Verdict("straggler_thermal", 0.85, a.ranks, a.hosts, facts)
                    if reasons & POWER_REASONS:
                        facts.append(EvidenceItem(
                            fact=f"GPU {g.index} on {host} power throttled "
                                 f"({', '.join(sorted(reasons))})", source="nvml",
                            value=sorted(reasons)))
                        return Verdict("straggler_power", 0.85, a.ranks, a.hosts, facts)
        phases = a.evidence.get("phases") or {}
        if isinstance(phases, dict) and phases:
            data = sum(float(v.get("data", 0.0)) if isinstance(v, dict) else 0.0
                       for v in phases.values())
            total = sum(sum(float(x) for x in v.values()) if isinstance(v, dict) else 0.0
                        for v in phases.values())
            if total and data / total > 0.5:
                facts.append(EvidenceItem(fact="the data phase dominates the slow rank's step",
                                          source="detector", value=round(data / total, 3)))
                return Verdict("data_pipeline", 0.7, a.ranks, a.hosts, facts)
        facts.append(EvidenceItem(fact="slow compute with no hardware evidence",
                                  source="detector", value=a.evidence.get("ratio")))
        return Verdict("straggler", 0.7, a.ranks, a.hosts, facts)

    def _gpu_findings(self, hosts: list[str], now: float) -> list[tuple[Cause, EvidenceItem]]:
        """Fatal XIDs or rising uncorrectable ECC on these hosts within the GPU window."""
        found: list[tuple[Cause, EvidenceItem]] = []
        for host in hosts:
            samples = [s for s in self.gpu.get(host, ()) if now - s.time <= self.gpu_window]
            for s in samples:
                for x in s.xids:
                    xid = XIDS.get(x.code)
                    if xid is not None and xid.fatal:
                        found.append((xid.cause, EvidenceItem(
                            fact=f"XID {x.code} on {host} GPU {x.gpu}: {xid.meaning}",
                            source="nvml", value=x.code)))
            firsts: dict[int, int] = {}
            for s in samples:
                for g in s.gpus:
                    value = g.ecc_uncorrected_volatile
                    if value is None:
                        continue
                    if g.index in firsts and value > firsts[g.index]:
                        found.append(("hbm_ecc", EvidenceItem(
                            fact=f"uncorrectable ECC on {host} GPU {g.index} rose "
                                 f"{firsts[g.index]} -> {value}", source="nvml", value=value)))
                        break
                    firsts.setdefault(g.index, value)
        found.sort(key=lambda f: 0 if f[0] == "gpu_lost" else 1)
        return found

    def _root_exit(self, job: str, now: float) -> WorkerExit | None:
        """The first exit no command initiated, within the window."""
        recent = [e for e in self.exits.get(job, ()) if not e.initiated_by
                  and e.exit_code not in (0, None) and now - e.time <= self.window]
        non_peer = [e for e in recent
                    if not PEER_ERROR.search(f"{e.error}\n{e.stderr_tail}")]
        pool = non_peer or recent
        return min(pool, key=lambda e: e.time) if pool else None


def _hosts_of(a: Anomaly, ranks: list[int]) -> list[str]:
    phases: dict[str, Any] = a.evidence.get("phases") or {}
    hosts = sorted({str(p.get("host")) for r, p in phases.items()
                    if int(r) in ranks and isinstance(p, dict) and p.get("host")})
    return hosts or a.hosts


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


_ADDRESSES = re.compile(r"0x[0-9a-f]+|\b\d+\b")


def traceback_signature(text: str) -> str:
    """A short hash of the exception line with numbers stripped: equal for the same error
    raised again (so the remediator can escalate a repeating traceback)."""
    line = next((ln for ln in reversed(text.strip().splitlines())
                 if re.match(r"\s*(\[\w+\]:)?\s*\w+(Error|Exception)", ln)), "")
    if not line:
        return ""
    return hashlib.sha1(_ADDRESSES.sub("#", line.strip()).encode()).hexdigest()[:12]


def summarize(a: Anomaly, v: Verdict, recommended: list[str]) -> str:
    who = f"rank{'s' if len(v.ranks) != 1 else ''} {', '.join(map(str, v.ranks[:6]))}" \
        if v.ranks else "the job"
    where = f" on {', '.join(v.hosts[:4])}" if v.hosts else ""
    reason = next((f.fact for f in reversed(v.facts) if f.source != "detector"
                   or "stuck" in f.fact or "every rank" in f.fact), a.kind)
    return (f"{who}{where}: {v.cause.replace('_', ' ')} ({reason}); "
            f"recommend {' -> '.join(recommended)}")
