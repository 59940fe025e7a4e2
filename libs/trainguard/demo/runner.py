"""Plays a fault schedule against a :class:`Cluster` and judges each outcome.

For every fault: wait until training is healthy, inject the drill (the same commands as
``trainguard inject``), then follow the anomaly, the diagnosis, the incident and its
actions until training has recovered, and record how long each took.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field

from trainguard.contract.codec import encode_durable
from trainguard.contract.envelope import make_headers
from trainguard.contract.schemas import Anomaly, AnomalyKind, Incident
from trainguard.contract.subjects import Subjects
from trainguard.contract.targets import addressed

from .cluster import Cluster, Observer
from .scenario import Fault

LINGERING: frozenset[AnomalyKind] = frozenset({"gpu_health", "checkpoint_slow"})
"""Kinds that stay open after the job is back (a GPU's record resolves after minutes
without new evidence): they do not hold the next drill."""


@dataclass
class Outcome:
    fault: Fault
    injected_at: float = 0.0
    injected_step: int = -1
    detected_at: float | None = None
    anomaly_ranks: list[int] = field(default_factory=list)
    cause: str | None = None
    actions: list[str] = field(default_factory=list)
    recovered_at: float | None = None
    steps_lost: int | None = None
    incident_status: str | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def seconds(self, t: float | None) -> str:
        return "-" if t is None else f"{t - self.injected_at:.1f}s"


class Runner:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.obs: Observer = cluster.observer
        self.started = time.time()
        self.outcomes: list[Outcome] = []

    async def command(self, fault: Fault, kind: str, params: dict[str, object]) -> None:
        host = fault.host or ("node-a" if (fault.rank or 0) < 2 else "node-b")
        subject, cmd = addressed(Subjects(self.cluster.prefix), self.cluster.job, kind, params,
                                 issuer="cli", rank=fault.rank, host=host)
        await self.cluster.publish(subject, encode_durable(cmd),
                                   make_headers(cmd, source="trainguard/demo", subject=subject))

    def open_anomalies(self) -> list[Anomaly]:
        """Anomalies whose newest revision is still open, of kinds that say the job is not
        back to normal (a GPU's health record and slow saves linger by design)."""
        newest: dict[str, Anomaly] = {}
        for a in self.obs.anomalies:
            if a.id not in newest or a.rev >= newest[a.id].rev:
                newest[a.id] = a
        return [a for a in newest.values() if a.status == "open" and a.kind not in LINGERING]

    def unsettled(self) -> str:
        """Why the job is not healthy yet ("" once it is): an incident still handled, an
        anomaly still open, or fewer ranks stepping than the job's world size."""
        busy = [i for i in self.obs.incidents.values() if i.status in ("open", "mitigating")]
        if busy:
            return f"incident {busy[0].id[-6:]} {busy[0].cause} {busy[0].status}"
        still = self.open_anomalies()
        if still:
            return f"anomaly {still[0].kind} on ranks {still[0].ranks} open"
        world = self.obs.world_sizes[-1][1] if self.obs.world_sizes else 0
        live = self.obs.live_ranks()
        if len(live) < world:
            return f"{len(live)} of {world} ranks heard"
        return ""

    async def healthy(self, timeout: float = 180.0) -> None:
        """The previous fault is over: no incident is being handled, no anomaly is open,
        every rank of the job is heard, and then every rank completes 3 more steps. Each
        drill starts from there, so one drill's aftermath (a straggler still slowing down,
        a group still re-forming) never bleeds into the next one's attribution."""
        deadline = time.monotonic() + timeout
        since: dict[int, int] | None = None
        why = ""
        while time.monotonic() < deadline:
            why = self.unsettled()
            if why:
                since = None
            else:
                steps = {r: v.step for r in self.obs.live_ranks()
                         if (v := self.obs.ranks[r]).step is not None}
                if since is None or set(since) != set(steps):
                    since = steps
                elif all(steps[r] >= since[r] + 3 for r in since):
                    return
            await asyncio.sleep(0.2)
        raise TimeoutError(f"training did not become healthy again: {why or 'no progress'}")

    async def play(self, fault: Fault) -> Outcome:
        await self.healthy()
        out = Outcome(fault, injected_at=time.time(), injected_step=self.obs.max_step)
        self.obs.timeline.append((out.injected_at, f"INJECT    {fault.name} ({fault.kind} "
                                                   f"rank {fault.rank} host {fault.host})"))
        seen_anomalies = len(self.obs.anomalies)
        await self.command(fault, fault.kind, fault.params)
        deadline = time.monotonic() + fault.timeout
        incident: Incident | None = None
        undone = False
        while time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            fresh = [a for a in self.obs.anomalies[seen_anomalies:]
                     if a.kind == fault.anomaly and a.detected_at >= out.injected_at - 1]
            if fresh and out.detected_at is None:
                out.detected_at = fresh[0].detected_at
                out.anomaly_ranks = fresh[0].ranks
            if fresh and fault.undo and not undone:
                await self.command(fault, *fault.undo)
                undone = True
            incident = self._incident_for(out.injected_at)
            if incident is not None and self._recovered(fault, out, incident):
                break
        if incident is not None:
            out.cause = incident.cause
            out.incident_status = incident.status
            out.actions = [f"{a.action}:{a.status}" for a in incident.actions]
            out.steps_lost = incident.steps_lost
        self._judge(out, incident)
        if out.problems:
            out.problems.append("incidents: " + ", ".join(
                f"{i.id[-6:]} {i.cause} {i.status} at "
                f"{(i.detected_at or 0) - out.injected_at:+.1f}s"
                for i in self.obs.incidents.values()))
        self.outcomes.append(out)
        return out

    def _incident_for(self, since: float) -> Incident | None:
        fresh = [i for i in self.obs.incidents.values() if (i.detected_at or 0) >= since - 1]
        return min(fresh, key=lambda i: i.detected_at or 0) if fresh else None

    def _recovered(self, fault: Fault, out: Outcome, inc: Incident) -> bool:
        if fault.recovery == "alert":
            if any(a.action == "alert" for a in inc.actions) and inc.status != "open":
                out.recovered_at = inc.mitigated_at or time.time()
                return True
            return False
        if inc.status not in ("resolved", "escalated"):
            return False
        if fault.recovery == "world_shrinks":
            shrunk = [t for t, w in self.obs.world_sizes if t >= out.injected_at and w == 2]
            if not shrunk or self.obs.max_step <= out.injected_step:
                return False
        if fault.recovery == "fingerprints_agree":
            later = [fp for step, fp in sorted(self.obs.fingerprints.items())
                     if step > out.injected_step and len(fp) >= len(self.obs.live_ranks())]
            if not later or len(set(later[-1].values())) != 1:
                return False
        out.recovered_at = inc.resolved_at or time.time()
        return inc.status == "resolved" or fault.recovery != "step_past"

    def _judge(self, out: Outcome, inc: Incident | None) -> None:
        f = out.fault
        if out.detected_at is None:
            out.problems.append(f"no {f.anomaly} anomaly")
        elif f.rank is not None and f.anomaly in ("straggler", "hang", "crash") \
                and f.rank not in out.anomaly_ranks:
            out.problems.append(f"anomaly named ranks {out.anomaly_ranks}, not {f.rank}")
        if inc is None:
            out.problems.append("no incident")
            return
        if inc.cause not in f.causes:
            out.problems.append(f"cause {inc.cause}, expected {' or '.join(f.causes)}")
        done = {a.action for a in inc.actions if a.status in ("done", "skipped")}
        missing = [a for a in f.actions if a not in done]
        if missing:
            out.problems.append(f"actions missing: {', '.join(missing)}")
        if out.recovered_at is None:
            out.problems.append(f"not recovered ({f.recovery}, incident {inc.status})")

    def goodput(self) -> float:
        """Productive training time over wall time: distinct steps completed times the
        median step time, over the time since the job started."""
        wall = time.time() - self.started
        times = [r.step_time for r in self.obs.ranks.values() if r.step_time]
        if not times or wall <= 0:
            return 0.0
        return min(1.0, (self.obs.max_step + 1) * statistics.median(times) / wall)
