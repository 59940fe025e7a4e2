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

import msgspec

from trainguard.contract.domains import Topology
from trainguard.contract.envelope import uuid7
from trainguard.contract.evidence import (
    BadBatchEvidence,
    CheckpointSlowEvidence,
    CpuLoad,
    CrashEvidence,
    DataStallEvidence,
    GpuHealthEvidence,
    GradExplosionEvidence,
    GradVanishingEvidence,
    HangEvidence,
    LossSpikeEvidence,
    NonfiniteEvidence,
    SdcMismatchEvidence,
    StragglerEvidence,
    ThroughputDropEvidence,
    UnresponsiveEvidence,
)
from trainguard.contract.schemas import (
    Anomaly,
    Cause,
    Diagnosis,
    EvidenceItem,
    GpuSample,
    WorkerExit,
)
from trainguard.health import checks
from trainguard.runtime import xids

from . import signatures
from .causality import OpenAnomalies
from .knowledge import HOT_C, PEER_ERROR, POWER_REASONS, RECOMMENDED, THERMAL_REASONS, TRACEBACK
from .together import Group, HostLosses

ROOT_CAUSES: frozenset[Cause] = frozenset({"gpu_lost", "hbm_ecc", "oom", "process_crash",
                                           "sdc_suspect", "numeric", "hosts_lost"})
SYMPTOM_KINDS = frozenset({"hang", "unresponsive", "crash", "throughput_drop"})
SYMPTOM_CAUSES: frozenset[Cause] = frozenset({"network", "rank_hang", "unknown"})
"""Causes that are often a guess made from a symptom before the root shows up."""
UNRECOGNISED = "no known error in the exit text"
"""How the exit fallback's evidence begins: the page says the cause is a default."""
FALLBACK_CONFIDENCE = 0.35
"""An exit nothing recognised: ``process_crash`` by default, far below any signature."""


@dataclass
class Conclusion:
    cause: Cause
    confidence: float
    ranks: list[int]
    hosts: list[str]
    facts: list[EvidenceItem]
    collateral: bool = False
    """The anomaly is a consequence of another rank's failure (a peer error)."""
    signature: str = ""
    recommended: tuple[str, ...] | None = None
    """Actions that replace the cause's defaults (an XID's, from NVIDIA's catalog)."""
    recognised: bool = True
    """False for the exit fallback: no signature, no hardware evidence named the cause, so
    the verdict is a low-confidence ``process_crash`` that explains nothing else."""
    domain: str = ""
    """``hosts_lost``: the failure domain the hosts share (empty: unknown)."""


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
    wait: float = 0.0
    """Decide the anomaly again in this many seconds: a host's silence waits for the
    others of its failure domain (:mod:`.together`); nothing is published meanwhile."""


@dataclass
class HostRecord:
    """What Redis remembers of a host's past diagnoses."""

    counts: dict[str, int] = field(default_factory=dict)


class Diagnoser:
    def __init__(self, *, window: float = 60.0, gpu_window: float = 120.0,
                 same_cause_window: float = 10.0, symptom_window: float = 20.0,
                 steal_pct: float = 10.0, load_ratio: float = 1.5,
                 domain_window: float = 0.0, topology: Topology | None = None,
                 burst_window: float = 0.0) -> None:
        self.window = window
        self.burst_window = burst_window
        """Crashes of one job and cause this close in onset crashed together (a storm, a
        bug every rank hits at one step): one failure whatever their hosts, unless the
        cause isolates hosts (each host's own). 0: together only on the same host."""
        self.lost = HostLosses(domain_window, topology)
        """Silences held for the domain window, then diagnosed as one loss per domain."""
        self.steal_pct = steal_pct
        """CPU time stolen by the hypervisor above which a straggler's CPUs are contended."""
        self.load_ratio = load_ratio
        """Load (or runnable tasks) per CPU above which a straggler's CPUs are contended."""
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
        self.live = OpenAnomalies()
        """Anomalies still open on the detector's side: the roots symptoms are joined to."""

    # -- observations ---------------------------------------------------------------------
    def observe_exit(self, ex: WorkerExit) -> None:
        self.exits[ex.job].append(ex)

    def observe_gpu(self, sample: GpuSample) -> None:
        self.gpu[sample.host].append(sample)

    # -- decisions ------------------------------------------------------------------------
    def follow(self, a: Anomaly) -> None:
        """Note an anomaly's transition (open, widened, resolved) without deciding."""
        self.live.observe(a)
        if a.status == "resolved":
            self.lost.forget(a)

    def on_anomaly(self, a: Anomaly, now: float,
                   history: dict[str, HostRecord] | None = None) -> Decision:
        self.follow(a)
        if a.status == "resolved":
            return Decision()
        history = history or {}
        v = self.classify(a, now)
        self._expire(a.job, now)
        opened = self.open[a.job]
        for o in opened:
            if a.id in o.diagnosis.anomaly_ids:
                return Decision()  # a redelivered anomaly
        group: Group | None = None
        if self.lost.is_loss(a):
            for o in opened:
                if self.lost.fits(a, o.diagnosis):
                    return Decision([self._widen(o, a, now)])
            wait = self.lost.hold(a, now)
            if wait > 0:
                return Decision(wait=wait)
            group = self.lost.take(a)
            if len(group.members) > 1:
                v = Conclusion("hosts_lost", 0.8 if group.domain else 0.6, group.ranks,
                               group.hosts, group.facts(), domain=group.name)
        elif a.kind in SYMPTOM_KINDS and not v.collateral and v.cause not in ROOT_CAUSES:
            wait = self.lost.waiting(a.job, now)  # a hang while hosts go: their symptom
            if wait > 0:
                return Decision(wait=wait)
        root = self._absorbing(a, opened)
        if root is not None:
            return Decision([self._join(root, a, v, now, collateral=True)])
        for o in opened:
            if self._crashed_with(v, a, o):
                return Decision([self._join(o, a, v, now, collateral=False, hosts=True)])
        for o in opened:
            if self._joins(v, a, o, now):
                # A domain's loss names its ranks already: what follows adds none.
                consequence = v.collateral or o.diagnosis.cause == "hosts_lost"
                return Decision([self._join(o, a, v, now, collateral=consequence)])
        diagnosis = self._diagnosis(a, v, now, history)
        if group is not None and len(group.members) > 1:
            self._lost_together(diagnosis, group)
        decision = Decision([diagnosis])
        for o in opened:
            od = o.diagnosis
            overlap = bool(set(v.ranks) & set(od.ranks) or set(v.hosts) & set(od.hosts))
            recent = now - o.last <= 3 * self.same_cause_window
            # A root explains a recent symptom-like guess; any cause beats "unknown" on the
            # same ranks.
            explains = v.cause in ROOT_CAUSES and not v.collateral and recent \
                and od.cause in SYMPTOM_CAUSES and v.recognised \
                and (overlap or v.cause != "hosts_lost")  # a domain's loss: its hosts' only
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
        """Forget diagnoses older than the window, except those whose anomalies the detector
        still holds open (a straggler can last an hour: what follows from it still joins)."""
        self.open[job] = [o for o in self.open[job] if now - o.at <= self.window
                          or self.live.any_open(job, o.diagnosis.anomaly_ids)]

    def _absorbing(self, a: Anomaly, opened: list[Open]) -> Open | None:
        """The open diagnosis of a failure that is still open and explains ``a``
        (:data:`.causality.ABSORBED_BY`), newest first; None if there is none."""
        roots = self.live.roots_of(a)
        if not roots:
            return None
        for o in reversed(opened):
            if o.diagnosis.status == "open" and roots & set(o.diagnosis.anomaly_ids):
                return o
        return None

    @staticmethod
    def _lost_together(d: Diagnosis, group: Group) -> None:
        """``d``, made from one of ``group``'s silences, speaks for all of them."""
        d.anomaly_ids = [m.id for m in group.members]
        d.onset_at = min(m.onset_at for m in group.members)
        d.summary = (f"{group.headline()}: hosts lost (heartbeats stopped, no exit "
                     f"reported); recommend {' -> '.join(d.recommended)}")

    @staticmethod
    def _widen(o: Open, a: Anomaly, now: float) -> Diagnosis:
        """A silence decided after its group: one more host of the same domain's loss."""
        d = o.diagnosis
        o.last = now
        d.anomaly_ids.append(a.id)
        d.ranks = sorted(set(d.ranks) | set(a.ranks))
        d.hosts = sorted(set(d.hosts) | set(a.hosts))
        late = round(a.onset_at - (d.onset_at or a.onset_at), 3)
        d.evidence.append(EvidenceItem(fact=f"{', '.join(a.hosts)} lost too ({late:+.1f} s "
                                       "after the first)", source=f"anomaly:{a.id}"))
        d.rev += 1
        return d

    @staticmethod
    def _join(o: Open, a: Anomaly, v: Conclusion, now: float, *, collateral: bool,
              hosts: bool = False) -> Diagnosis:
        """``a`` is a symptom of ``o``'s failure, or (``hosts``) another part of it: a new
        revision of its diagnosis."""
        d = o.diagnosis
        o.last = now
        d.anomaly_ids.append(a.id)
        d.worker_exited = d.worker_exited or a.kind == "crash"
        if collateral:
            d.collateral.append(a.id)
        else:
            d.ranks = sorted(set(d.ranks) | set(v.ranks))
        if hosts:
            d.hosts = sorted(set(d.hosts) | set(v.hosts))
            late = round(a.onset_at - (d.onset_at or a.onset_at), 3)
            fact = f"{a.kind} on ranks {a.ranks} ({', '.join(a.hosts)}) {late:+.1f} s after " \
                   "the first: crashed together"
        else:
            fact = f"{a.kind} on ranks {a.ranks} follows from this failure"
        d.evidence.append(EvidenceItem(fact=fact, source=f"anomaly:{a.id}"))
        d.rev += 1
        return d

    def _crashed_with(self, v: Conclusion, a: Anomaly, o: Open) -> bool:
        """``a``, a crash, is one more rank of ``o``'s crash: the same cause, onsets within
        ``burst_window``, and a cause whose action is the job's, not each host's."""
        d = o.diagnosis
        return self.burst_window > 0 and a.kind == "crash" and d.worker_exited \
            and d.status == "open" and v.cause == d.cause and not v.collateral \
            and "isolate" not in RECOMMENDED[v.cause] and d.onset_at is not None \
            and abs(a.onset_at - d.onset_at) <= self.burst_window

    def _joins(self, v: Conclusion, a: Anomaly, o: Open, now: float) -> bool:
        d = o.diagnosis
        if d.status != "open" or (d.cause == "hosts_lost" and self.lost.is_loss(a)):
            return False  # another host's silence is not a symptom of a domain's loss
        if v.collateral or (o.root and a.kind in SYMPTOM_KINDS and v.cause not in ROOT_CAUSES
                            and now - o.last <= self.symptom_window
                            and self.live.any_open(a.job, d.anomaly_ids)):
            # A symptom of an open root failure. One whose anomalies the detector resolved
            # (its rank replaced in place, training on again) explains nothing new: a rank
            # that hangs right after is a failure of its own.
            return True
        return v.cause == d.cause and now - o.last <= self.same_cause_window \
            and (not d.hosts or bool(set(v.hosts) & set(d.hosts)))

    def _diagnosis(self, a: Anomaly, v: Conclusion, now: float,
                   history: dict[str, HostRecord]) -> Diagnosis:
        confidence = v.confidence
        recommended = list(RECOMMENDED[v.cause] if v.recommended is None else v.recommended)
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
                         step=a.step, time=now, domain=v.domain,
                         worker_exited=a.kind == "crash")

    # -- classification -------------------------------------------------------------------
    def classify(self, a: Anomaly, now: float) -> Conclusion:
        facts = [EvidenceItem(fact=f"{a.kind} anomaly on ranks {a.ranks}", source="detector",
                              value=a.id)]
        hw = self._gpu_findings(a.hosts, now)
        # The evidence Struct is the anomaly kind's (Anomaly.__post_init__ makes sure).
        match a.evidence:
            case CrashEvidence() as ev:
                return self._crash(a, ev, facts, hw, now)
            case GpuHealthEvidence() as ev:
                return self._gpu_health(a, ev, facts, hw)
            case HangEvidence() as ev:
                return self._hang(a, ev, facts, hw)
            case UnresponsiveEvidence():
                if hw:
                    return Conclusion(hw[0][0], 0.8, a.ranks, a.hosts, [*facts, hw[0][1]])
                facts.append(EvidenceItem(fact="heartbeats stopped with no exit reported",
                                          source="detector"))
                return Conclusion("unknown", 0.3, a.ranks, a.hosts, facts)
            case BadBatchEvidence() as ev:
                return self._bad_batch(a, ev, facts)
            case NonfiniteEvidence() as ev:
                if ev.bad_batch_ranks:
                    facts.append(EvidenceItem(
                        fact=f"ranks {ev.bad_batch_ranks} fed NaN/Inf input to the model at "
                             f"step {a.step}: the batch, not the training, went bad first "
                             "(the job lets bad batches train)",
                        source="detector", value=ev.bad_batch_ranks))
                origin = nonfinite_origin(a, ev)
                if ev.minority:
                    facts.append(EvidenceItem(fact="only a minority of data-parallel ranks saw "
                                              "NaN/Inf before the all-reduce", source="detector",
                                              value=ev.nonfinite_ranks))
                    facts.extend(origin)
                    return Conclusion("sdc_suspect", 0.7, a.ranks, a.hosts, facts)
                facts.append(EvidenceItem(fact="NaN/Inf on every rank", source="detector",
                                          value=ev.loss))
                facts.extend(origin)
                return Conclusion("numeric", 0.85, a.ranks, a.hosts, facts)
            case GradExplosionEvidence() as ev:
                facts.extend(largest_gradients(a, ev))
                return Conclusion("numeric", 0.6, a.ranks, a.hosts, facts)
            case GradVanishingEvidence() | LossSpikeEvidence():
                return Conclusion("numeric", 0.6, a.ranks, a.hosts, facts)
            case SdcMismatchEvidence() as ev:
                facts.append(EvidenceItem(fact="replica fingerprints disagree at one step",
                                          source="detector", value=ev.suspects))
                return Conclusion("sdc_suspect", 0.5 if ev.tie else 0.85, a.ranks, a.hosts, facts)
            case StragglerEvidence() as ev:
                return self._straggler(a, ev, facts, now)
            case DataStallEvidence():
                return Conclusion("data_pipeline", 0.8, a.ranks, a.hosts, facts)
            case ThroughputDropEvidence():
                return Conclusion("unknown", 0.3, a.ranks, a.hosts, facts)
            case CheckpointSlowEvidence():
                return Conclusion("storage_io", 0.8, a.ranks, a.hosts, facts)
        return Conclusion("unknown", 0.2, a.ranks, a.hosts, facts)

    @staticmethod
    def _bad_batch(a: Anomaly, ev: BadBatchEvidence, facts: list[EvidenceItem]) -> Conclusion:
        for rank, f in ev.faults.items():
            where = f" in {f.key}" if f.key else ""
            sample = f", sample {f.sample_id or f.sample}" if f.sample is not None else ""
            source = f" from {f.source}" if f.source else ""
            facts.append(EvidenceItem(
                fact=f"rank {rank}'s batch at step {a.step}: {f.kind}{where}{sample}{source}"
                     f" ({f.detail})", source="rank", value=msgspec.to_builtins(f)))
        facts.append(EvidenceItem(
            fact="every rank skipped the step: the model was not updated from it"
            if ev.skipped else "the batch reached the model (the job lets bad batches train)",
            source="rank"))
        return Conclusion("data_pipeline", 0.9, a.ranks, a.hosts, facts)

    def _hang(self, a: Anomaly, ev: HangEvidence, facts: list[EvidenceItem],
              hw: list[tuple[Cause, EvidenceItem]]) -> Conclusion:
        if hw and (hw[0][0] in ("gpu_lost", "hbm_ecc")):
            return Conclusion(hw[0][0], 0.85, a.ranks, a.hosts, [*facts, hw[0][1]])
        culprits = ev.culprits
        if culprits:
            where = {r: p.phase if (p := ev.phases.get(str(r))) is not None else None
                     for r in culprits}
            facts.append(EvidenceItem(fact=f"ranks {culprits} stuck outside the "
                                      f"collective ({ev.culprit_basis})", source="detector",
                                      value=where))
            quiet = {r: p.quiet_for for r in culprits
                     if (p := ev.phases.get(str(r))) is not None and p.quiet_for}
            if quiet:
                facts.append(EvidenceItem(
                    fact=f"ranks {sorted(quiet)} did no work where they stopped (no CPU, no "
                         "I/O in the process or its loader workers): stuck, not slow",
                    source="rank", value={str(r): s for r, s in quiet.items()}))
            conf = 0.9 if ev.culprit_basis == "process_state" else 0.8
            return Conclusion("rank_hang", conf, culprits, _hosts_of(a, ev, culprits), facts)
        if ev.majority_phase == "comm":
            facts.append(EvidenceItem(fact="every rank waits in the collective",
                                      source="detector", value=ev.phase_counts))
            # The flight-recorder dumps a dump collects can still name who stopped short.
            return Conclusion("network", 0.7, a.ranks, a.hosts, facts,
                           recommended=("dump", "restart"))
        if ev.majority_phase == "data":
            return Conclusion("data_pipeline", 0.6, a.ranks, a.hosts, facts)
        return Conclusion("unknown", 0.3, a.ranks, a.hosts, facts)

    def _crash(self, a: Anomaly, ev: CrashEvidence, facts: list[EvidenceItem],
               hw: list[tuple[Cause, EvidenceItem]], now: float) -> Conclusion:
        text = f"{ev.error}\n{ev.stderr_tail}"
        root = self._root_exit(a.job, now)
        lost_peer = PEER_ERROR.search(text)
        if lost_peer and root is not None and root.rank not in a.ranks:
            facts.append(EvidenceItem(fact=f"peer error after rank {root.rank} on {root.host} "
                                      "exited first", source="exit", value=root.id))
            return Conclusion("network", 0.5, [root.rank], [root.host], facts, collateral=True)
        found = signatures.match(text) or signatures.killed(ev.exit_code, ev.signal)
        # Its own words say only that a peer went away (a host isolated or lost, whose
        # ranks' exits say nothing): a symptom, which joins that root when one is open.
        # Its own host's GPU evidence does not explain another host's going.
        only_lost_peer = lost_peer is not None and root is None \
            and (found is None or found.cause == "network")
        if hw and not only_lost_peer:
            cause, item = hw[0]
            return Conclusion(cause, 0.95, a.ranks, a.hosts, [*facts, item])
        signature = traceback_signature(text)
        if found is not None:
            facts.append(EvidenceItem(fact=found.fact, source="exit", value=found.matched))
            ranks, hosts = self._behind(a, found, text, facts, now)
            return Conclusion(found.cause, found.weight, ranks, hosts, facts,
                           signature=signature, recommended=found.recommended)
        sig = ev.signal
        if TRACEBACK.search(text) or sig or ev.exit_code:
            facts.append(EvidenceItem(
                fact=f"{UNRECOGNISED}: exited with code {ev.exit_code}"
                     f"{' (' + sig + ')' if sig else ''}, no hardware or OOM evidence",
                source="exit", value=last_line(text)))
            return Conclusion("process_crash", FALLBACK_CONFIDENCE, a.ranks, a.hosts, facts,
                              signature=signature, recognised=False)
        return Conclusion("unknown", 0.3, a.ranks, a.hosts, facts, recognised=False)

    def _behind(self, a: Anomaly, found: signatures.Match, text: str,
                facts: list[EvidenceItem], now: float) -> tuple[list[int], list[str]]:
        """For a collective timeout, the ranks NCCL's watchdog numbers say are behind
        (from this exit and the job's other recent exits); else the anomaly's ranks."""
        if found.name not in signatures.WATCHDOG:
            return a.ranks, a.hosts
        recent = [e for e in self.exits.get(a.job, ()) if now - e.time <= self.window]
        progress = signatures.watchdog_progress(text)
        for e in recent:
            progress += signatures.watchdog_progress(f"{e.error}\n{e.stderr_tail}")
        late = signatures.behind(progress)
        if not late:
            return a.ranks, a.hosts
        facts.append(EvidenceItem(fact=f"ranks {sorted(late)} are behind their group "
                                  "(NCCL watchdog sequence numbers)", source="exit",
                                  value={str(r): why for r, why in late.items()}))
        hosts = sorted({e.host for e in recent if e.rank in late}) or a.hosts
        return sorted(late), hosts

    def _gpu_health(self, a: Anomaly, ev: GpuHealthEvidence, facts: list[EvidenceItem],
                    hw: list[tuple[Cause, EvidenceItem]]) -> Conclusion:
        for x in ev.xids:
            xid = xids.lookup(x.code)
            if xid is not None:
                facts.append(EvidenceItem(fact=f"XID {x.code}: {xid.meaning}", source="nvml",
                                          value=x.code))
                return Conclusion(xid.cause, 0.95 if xid.fatal else 0.7, a.ranks, a.hosts, facts,
                               recommended=signatures.xid_actions(xid))
        rises = ev.ecc_rises()
        if rises:
            facts.append(EvidenceItem(fact="uncorrectable ECC count rising", source="nvml",
                                      value=rises))
            return Conclusion("hbm_ecc", 0.9, a.ranks, a.hosts, facts)
        if hw:
            return Conclusion(hw[0][0], 0.8, a.ranks, a.hosts, [*facts, hw[0][1]])
        return Conclusion("unknown", 0.3, a.ranks, a.hosts, facts)

    def _straggler(self, a: Anomaly, ev: StragglerEvidence, facts: list[EvidenceItem],
                   now: float) -> Conclusion:
        """The straggler checklist on the slow rank's host, from the agent's recent
        samples: GPU clocks held down (thermal, power), fatal GPU errors in the kernel log,
        a degraded InfiniBand/RoCE link, a foreign process on the GPUs, contended CPUs.
        The first that holds names the cause; none: a plain straggler."""
        for host in a.hosts:
            samples = [x for x in self.gpu.get(host, ()) if now - x.time <= self.gpu_window]
            found = self._throttled(host, samples) or self._host_cause(host, samples, now)
            if found is not None:
                cause, item = found
                facts.append(item)
                return Conclusion(cause, 0.85, a.ranks, a.hosts, facts)
        facts.append(EvidenceItem(fact="slow compute with no hardware evidence",
                                  source="detector", value=ev.ratio))
        return Conclusion("straggler", 0.7, a.ranks, a.hosts, facts)

    @staticmethod
    def _throttled(host: str, samples: list[GpuSample]) -> tuple[Cause, EvidenceItem] | None:
        for sample in reversed(samples):
            for g in sample.gpus:
                reasons = set(g.throttle_reasons)
                if reasons & THERMAL_REASONS or (g.temperature_c or 0) >= HOT_C:
                    return "straggler_thermal", EvidenceItem(
                        fact=f"GPU {g.index} on {host} thermally throttled "
                             f"({', '.join(sorted(reasons)) or 'hot'}, {g.temperature_c} C, "
                             f"{g.sm_clock_mhz} MHz)", source="nvml", value=sorted(reasons))
                if reasons & POWER_REASONS:
                    return "straggler_power", EvidenceItem(
                        fact=f"GPU {g.index} on {host} power throttled "
                             f"({', '.join(sorted(reasons))}, {g.sm_clock_mhz} MHz)",
                        source="nvml", value=sorted(reasons))
        return None

    def _peer_cpus(self, host: str, now: float) -> list[CpuLoad]:
        """The other hosts' newest CPU readings within the GPU window (contention counts
        only beyond theirs)."""
        out = []
        for other, samples in self.gpu.items():
            if other == host:
                continue
            cpu = next((x.facts.cpu for x in reversed(samples) if x.facts is not None
                        and x.facts.cpu is not None and now - x.time <= self.gpu_window), None)
            if cpu is not None:
                out.append(cpu)
        return out

    def _host_cause(self, host: str, samples: list[GpuSample],
                    now: float) -> tuple[Cause, EvidenceItem] | None:
        """What the host probe's newest reading (``GpuSample.facts``) says."""
        facts = next((x.facts for x in reversed(samples) if x.facts is not None), None)
        if facts is None:
            return None
        for line in reversed(checks.recent(facts.kernel, facts.uptime_s)):
            if checks.fatal_kernel_line(line):
                xid = xids.lookup(line.xid) if line.xid is not None else None
                cause: Cause = xid.cause if xid is not None else "hbm_ecc"
                return cause, EvidenceItem(fact=f"kernel log on {host}: {line.text[:200]}",
                                           source="kernel_log", value=line.xid)
        degraded = checks.degraded_ports(facts.ib_ports, facts.ib_expected_gbps)
        if degraded:
            return "straggler_link", EvidenceItem(
                fact=f"degraded link on {host}: {degraded[0].reason}", source="sysfs",
                value={c.name: c.value for c in degraded})
        if facts.foreign:
            who = ", ".join(f"pid {p.pid} ({p.name or '?'}, uid {p.user or '?'}) on GPU {p.gpu}"
                            for p in facts.foreign[:4])
            return "straggler_foreign_process", EvidenceItem(
                fact=f"foreign process on {host}'s GPUs: {who}", source="nvml",
                value=[p.pid for p in facts.foreign])
        why = checks.cpu_contention(facts.cpu, steal_pct=self.steal_pct,
                                    load_ratio=self.load_ratio, peers=self._peer_cpus(host, now))
        if why:
            return "straggler_cpu", EvidenceItem(fact=f"CPU contention on {host}: {why}",
                                                 source="procfs", value=facts.cpu)
        return None

    def _gpu_findings(self, hosts: list[str], now: float) -> list[tuple[Cause, EvidenceItem]]:
        """Fatal XIDs or rising uncorrectable ECC on these hosts within the GPU window."""
        found: list[tuple[Cause, EvidenceItem]] = []
        for host in hosts:
            samples = [s for s in self.gpu.get(host, ()) if now - s.time <= self.gpu_window]
            for s in samples:
                for x in s.xids:
                    xid = xids.lookup(x.code)
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
        """The first exit within the window that no command initiated and whose own words
        are not a lost peer's: an exit that only says a peer went away (a collective timed
        out, a connection closed) is no root, though it came first (the crash itself, its
        exit reported before it, or a rank that noticed the loss sooner)."""
        roots = [e for e in self.exits.get(job, ()) if not e.initiated_by
                 and e.exit_code not in (0, None) and now - e.time <= self.window
                 and not PEER_ERROR.search(f"{e.error}\n{e.stderr_tail}")]
        return min(roots, key=lambda e: e.time) if roots else None


def _hosts_of(a: Anomaly, ev: HangEvidence, ranks: list[int]) -> list[str]:
    """The hosts of ``ranks`` as the hang's evidence recorded them, else the anomaly's."""
    wanted = {str(r) for r in ranks}
    hosts = sorted({p.host for r, p in ev.phases.items() if r in wanted and p.host})
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


def _at(a: Anomaly) -> str:
    return f" at step {a.step}" if a.step is not None else ""


def nonfinite_origin(a: Anomaly, ev: NonfiniteEvidence) -> list[EvidenceItem]:
    """The fact naming where the gradients went non-finite first, if a rank named it."""
    if not ev.first_param:
        return []
    rank = f" on rank {ev.first_rank}" if ev.first_rank is not None else ""
    count = ev.params_affected
    if ev.param_basis == "parameter":
        fact = f"parameter {ev.first_param} itself holds NaN/Inf{rank}{_at(a)}"
    elif ev.param_basis == "forward":
        fact = (f"every gradient went non-finite{rank}{_at(a)} ({count} parameters): the "
                f"values were bad before backward (it reached {ev.first_param} first)")
    else:
        fact = (f"gradients went non-finite first in {ev.first_param}{rank}{_at(a)}"
                + (f" ({count} parameters affected)" if count else ""))
    return [EvidenceItem(fact=fact, source="step_report", value=ev.params)]


def largest_gradients(a: Anomaly, ev: GradExplosionEvidence) -> list[EvidenceItem]:
    """The fact naming the parameters with the largest gradients, if a rank named them."""
    if not ev.top_params:
        return []
    rank = f" on rank {ev.top_rank}" if ev.top_rank is not None else ""
    named = ", ".join(f"{name} (norm {norm:.3g})" for name, norm in ev.top_params.items())
    return [EvidenceItem(fact=f"largest gradients in {named}{rank}{_at(a)}",
                         source="step_report", value=ev.top_params)]


def summarize(a: Anomaly, v: Conclusion, recommended: list[str]) -> str:
    who = f"rank{'s' if len(v.ranks) != 1 else ''} {', '.join(map(str, v.ranks[:6]))}" \
        if v.ranks else "the job"
    where = f" on {', '.join(v.hosts[:4])}" if v.hosts else ""
    reason = next((f.fact for f in reversed(v.facts) if f.fact != "traceback signature"
                   and (f.source != "detector" or "stuck" in f.fact or "every rank" in f.fact)),
                  a.kind)
    return (f"{who}{where}: {v.cause.replace('_', ' ')} ({reason}); "
            f"recommend {' -> '.join(recommended)}")
