"""In-place recovery end to end: the control plane of ``trainguard up`` and two
``trainguard launch`` agents (the demo's cluster: node-a ranks 0-1 with the rendezvous
store, node-b ranks 2-3), 4 gloo ranks of the toy trainer with ``--in-place``
(deterministic, step-keyed data). A killed rank is replaced alone and the job ends with
the parameters of an uninterrupted run, with a plain all-reduce loop and with DDP
(``trainguard.torch.ddp``, rebuilt on the re-formed group); a hung rank is killed and
replaced; a NaN rolls back in place; two ranks lost at once fall back to the committed
checkpoint, and the incident says so and why; an isolated host leaves and the others go on
in place at world size 2, and with three agents the rank after an isolated middle host closes
up the gap; an isolated host that comes back is taken in at world size 4 while the others
keep running.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from tests.conftest import wait_until
from tests.e2e.conftest import job_env, torchrun
from trainguard.agent.exitcodes import EXIT_ISOLATED
from trainguard.contract.codec import decode_any_durable, decode_telemetry, encode_durable
from trainguard.contract.envelope import make_headers, normalize_headers
from trainguard.contract.schemas import (
    CommandAck,
    Heartbeat,
    Incident,
    RankHello,
    RecoveryReport,
)
from trainguard.contract.subjects import Subjects
from trainguard.contract.targets import addressed
from trainguard.core.connection import flush
from trainguard.demo.cluster import Cluster

pytestmark = pytest.mark.timeout(420)  # the cluster's start on a loaded machine, then the job
STEPS = 150
TRAINER = ["--seed", "3"]
RARE_SYNC = ["--sync-every", "1000", "--pg-timeout", "30"]
"""A lost peer is caught inside a step; collective commands (``reload``) are agreed every
``sync_every`` steps, so only the rollback test needs them often."""
OFTEN_SYNC = ["--sync-every", "5"]
HOST_OF = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}
C = TypeVar("C", bound="InPlaceCluster")


class InPlaceCluster(Cluster):
    """The demo's two agents running the tiny toy model in place, for a fixed run."""

    def __init__(self, workdir: Path, job: str, trainer: list[str],
                 hosts: tuple[str, ...] = ("node-a", "node-b"), nproc: int = 2,
                 steps: int = STEPS, ckpt_every: int = 10) -> None:
        super().__init__(workdir, job, steps=steps, step_time=0.05, ckpt_every=ckpt_every,
                         model="tiny", hosts=hosts, nproc=nproc)
        self.trainer = trainer
        self.final = workdir / "final.pt"
        self.pids: dict[int, list[int]] = {}
        """Each rank's pids, in the order its heartbeats showed them."""
        self.recoveries: list[RecoveryReport] = []
        self.hellos: list[RankHello] = []
        self.acks: list[CommandAck] = []

    def launch_argv(self, host: str) -> list[str]:
        return [*super().launch_argv(host), "--in-place", "--final-params", str(self.final),
                *TRAINER, *self.trainer]

    async def watch(self) -> None:
        s = Subjects(self.prefix)

        async def beat(msg: Any) -> None:
            with contextlib.suppress(Exception):
                hb = decode_telemetry(msg.data)
                if isinstance(hb, Heartbeat) and hb.pid:
                    seen = self.pids.setdefault(hb.rank, [])
                    if hb.pid not in seen:
                        seen.append(hb.pid)

        async def recovery(msg: Any) -> None:
            with contextlib.suppress(Exception):
                r = decode_any_durable(msg.data, normalize_headers(msg.headers).get("ce-type"))
                # A publish retried for want of an ack reaches core subscribers twice.
                if isinstance(r, RecoveryReport) and all(r.id != x.id
                                                         for x in self.recoveries):
                    self.recoveries.append(r)

        async def hello(msg: Any) -> None:
            with contextlib.suppress(Exception):
                h = decode_any_durable(msg.data, normalize_headers(msg.headers).get("ce-type"))
                if isinstance(h, RankHello):
                    self.hellos.append(h)

        async def ack(msg: Any) -> None:
            with contextlib.suppress(Exception):
                a = decode_any_durable(msg.data, normalize_headers(msg.headers).get("ce-type"))
                if isinstance(a, CommandAck):
                    self.acks.append(a)

        await self.nc.subscribe(s.pattern("ack", job=self.job), cb=ack)
        await self.nc.subscribe(s.pattern("hb", job=self.job), cb=beat)
        await self.nc.subscribe(s.pattern("recovery", job=self.job), cb=recovery)
        await self.nc.subscribe(s.pattern("reg", job=self.job), cb=hello)
        await flush(self.nc)

    async def drill(self, kind: str, rank: int | list[int], **params: Any) -> None:
        one = rank if isinstance(rank, int) else rank[0]
        if isinstance(rank, list):
            params["ranks"] = rank
        subject, cmd = addressed(Subjects(self.prefix), self.job, kind, params, issuer="cli",
                                 rank=one if isinstance(rank, int) else None,
                                 host=HOST_OF[one])
        await self.publish(subject, encode_durable(cmd),
                           make_headers(cmd, source="tests/e2e", subject=subject))

    async def isolate_in_place(self, host: str) -> RecoveryReport:
        """Isolate ``host`` once a checkpoint is committed; its launcher exits 200 and says
        the group re-forms without it. Returns the re-formed group's own resize report."""
        await wait_until(lambda: any(k.status == "committed" for k in self.observer.checkpoints),
                         timeout=60, what="a committed checkpoint")
        await self.isolate(host)
        await wait_until(lambda: self.procs[host].poll() is not None, timeout=90,
                         interval=0.5, what=f"{host}'s launcher to leave")
        assert self.procs[host].returncode == EXIT_ISOLATED, self.log_tail()
        [resize] = await wait_until(lambda: [r for r in self.recoveries if r.kind == "resize"
                                             and r.source_rank is not None],
                                    timeout=90, interval=0.5, what="the survivors' resize")
        await wait_until(lambda: [r for r in self.recoveries if r.kind == "resize"
                                  and r.source_rank is None and r.path == "in_place"],
                         timeout=30, interval=0.5, what=f"{host}'s word as it left")
        return resize

    async def isolate(self, host: str) -> None:
        subject, cmd = addressed(Subjects(self.prefix), self.job, "isolate", {}, issuer="cli",
                                 host=host)
        await self.publish(subject, encode_durable(cmd),
                           make_headers(cmd, source="tests/e2e", subject=subject))

    def come_back(self, host: str) -> None:
        """The operator ends ``host``'s blocklist entry, if it has one (an isolate command
        sent straight to the agent makes none), and its agent starts again."""
        unblock = subprocess.run(
            [sys.executable, "-m", "trainguard", "unblock", host, "--credentials",
             str(self.creds_dir / "operator.json")], env=self.env(), capture_output=True,
            text=True, timeout=60)
        assert unblock.returncode in (0, 1), unblock.stdout + unblock.stderr
        self.start_agent(host)

    def incident(self, cond: Callable[[Incident], bool]) -> Incident | None:
        return next((i for i in self.observer.incidents.values() if cond(i)), None)

    async def finished(self, timeout: float = 150.0) -> None:
        await wait_until(lambda: all(self.procs[h].poll() is not None
                                     for h in ("node-a", "node-b")), timeout=timeout,
                         interval=0.5, what="the job to finish on both agents")
        codes = {h: self.procs[h].returncode for h in ("node-a", "node-b")}
        assert codes == {"node-a": 0, "node-b": 0}, (codes, self.story(), self.log_tail())

    def story(self) -> list[str]:
        """Each incident and anomaly in a line: why a host left, when one should not have."""
        return [*(f"incident {i.cause} {i.status} hosts={i.hosts} ranks={i.ranks} "
                  f"actions={[(a.action, a.status, a.detail) for a in i.actions]}"
                  for i in self.observer.incidents.values()),
                *(f"anomaly {a.kind} ranks={a.ranks} step={a.step}"
                  for a in self.observer.anomalies)]

    def log_tail(self) -> str:
        return "\n".join((self.workdir / f"{h}.log").read_text(errors="replace")[-3000:]
                         for h in self.hosts)


@pytest.fixture
async def cluster(tmp_path: Path, job: str, request: pytest.FixtureRequest
                  ) -> AsyncIterator[InPlaceCluster]:
    name = request.node.name
    three = "middle_host" in name  # three agents of one rank each
    back = "comes_back" in name  # long enough for a host to leave and come back
    c = InPlaceCluster(tmp_path, job, [*(OFTEN_SYNC if "nan" in name or back else RARE_SYNC),
                                       *(["--ddp"] if "ddp" in name else [])],
                       *((("node-a", "node-b", "node-c"), 1) if three else ()),
                       **({"steps": 100_000} if back else {}),
                       **({"ckpt_every": 100_000} if "before_the_first" in name else {}))
    async with running(c):
        yield c


@contextlib.asynccontextmanager
async def running(c: C) -> AsyncIterator[C]:
    """``c`` started and watched, then stopped whatever happens."""
    try:
        await c.start(timeout=150)
        await c.watch()
        yield c
    finally:
        await c.stop()


def uninterrupted(tmp_path: Path, nats_url: str, prefix: str,
                  extra: list[str]) -> dict[str, torch.Tensor]:
    """The same job with no fault, under plain torchrun: the parameters to match."""
    out = tmp_path / "baseline.pt"
    log = tmp_path / "baseline.log"
    proc = torchrun(4, ["--job", "baseline", "--model", "tiny", "--steps", str(STEPS),
                        "--step-time", "0.0", "--in-place", "--final-params", str(out),
                        *TRAINER, *RARE_SYNC, *extra], job_env(nats_url, prefix), log)
    assert proc.wait(150) == 0, log.read_text()[-3000:]
    state: dict[str, torch.Tensor] = torch.load(out, weights_only=True)
    return state


def survivors_kept(c: InPlaceCluster, replaced: set[int]) -> None:
    for rank in range(4):
        if rank not in replaced:
            assert len(c.pids[rank]) == 1, (rank, c.pids)
    for rank in replaced:
        assert len(c.pids[rank]) == 2, (rank, c.pids)


@pytest.mark.parametrize("loop", ["all_reduce", "ddp"])
async def test_a_killed_rank_is_replaced_in_place_and_nothing_is_lost(
        cluster: InPlaceCluster, tmp_path: Path, nats_url: str, prefix: str,
        loop: str) -> None:
    c = cluster
    await wait_until(lambda: c.observer.max_step >= 20, timeout=60, what="step 20")
    await c.drill("kill", 2)
    await wait_until(lambda: c.incident(lambda i: i.status == "resolved") is not None,
                     timeout=120, interval=0.5, what="the incident resolved")
    await c.finished()
    inc = c.incident(lambda i: i.status == "resolved")
    assert inc is not None and inc.cause == "process_crash", inc
    assert inc.recovery is not None and inc.recovery.path == "in_place", inc.recovery
    assert inc.steps_lost == 0 and inc.recovery.back_at is not None
    assert [(a.action, a.status) for a in inc.actions] == [("restart", "skipped")]
    survivors_kept(c, {2})
    # The agent's word that it replaced the rank (no source yet), then the group's report.
    done = [r for r in c.recoveries if r.path == "in_place" and r.kind == "replace"
            and r.source_rank is not None]
    assert len(done) == 1 and done[0].joined == [2] and done[0].steps_lost == 0
    final: dict[str, torch.Tensor] = torch.load(c.final, weights_only=True)
    baseline = uninterrupted(tmp_path, nats_url, prefix, ["--ddp"] if loop == "ddp" else [])
    assert final.keys() == baseline.keys()
    # DDP built anew sums its first gradients in another order: equal to rounding (a step
    # lost or run twice moves them by ~1e-3), the plain loop bit for bit.
    atol = 1e-6 if loop == "ddp" else 0.0
    assert {k: (final[k] - v).abs().max().item() for k, v in baseline.items()
            if not torch.allclose(final[k], v, rtol=0, atol=atol)} == {}, "parameters differ"


async def test_a_hung_rank_is_killed_and_replaced_while_the_others_stay(
        cluster: InPlaceCluster) -> None:
    c = cluster
    await wait_until(lambda: c.observer.max_step >= 20, timeout=60, what="step 20")
    await c.drill("hang", 1, phase="data", seconds=3600)
    await wait_until(lambda: c.incident(lambda i: i.status == "resolved") is not None,
                     timeout=150, interval=0.5, what="the hang's incident resolved")
    inc = c.incident(lambda i: i.status == "resolved")
    assert inc is not None and inc.cause == "rank_hang", inc
    restart = next(a for a in inc.actions if a.action == "restart")
    assert restart.params.get("rank") == 1 and "replaced in place" in restart.detail, restart
    assert inc.recovery is not None and inc.recovery.path == "in_place"
    await c.finished()
    survivors_kept(c, {1})


async def test_a_nan_rolls_back_in_place_with_no_process_restarted(
        cluster: InPlaceCluster) -> None:
    c = cluster
    await wait_until(lambda: any(k.status == "committed" for k in c.observer.checkpoints),
                     timeout=60, what="a committed checkpoint")
    await c.drill("nan", 0)
    await wait_until(lambda: c.incident(lambda i: i.status == "resolved") is not None,
                     timeout=150, interval=0.5, what="the NaN's incident resolved")
    inc = c.incident(lambda i: i.status == "resolved")
    assert inc is not None and inc.cause == "numeric", inc
    assert [(a.action, a.status) for a in inc.actions] == [("rollback", "done"),
                                                          ("restart", "skipped")], inc.actions
    assert inc.recovery is not None and inc.recovery.kind == "rollback"
    assert inc.recovery.path == "in_place"
    # From the ranks' memory snapshots: the step before the onset, not a checkpoint
    # interval back.
    assert inc.recovery.tier == "memory", inc.recovery
    assert inc.failure_step is not None and inc.recovery.resumed_step == inc.failure_step
    await c.finished()
    survivors_kept(c, set())


async def test_a_nan_before_the_first_checkpoint_rolls_back_to_memory_in_place(
        cluster: InPlaceCluster) -> None:
    """Nothing on disk yet (no checkpoint in this run's first 150 steps): the coordinator
    has nothing to point at, the ranks' memory snapshots are all there is to go back to,
    and the reload takes them alone, where the rollback used to fail and escalate."""
    c = cluster
    await wait_until(lambda: all((v := c.observer.ranks.get(r)) is not None
                                 and (v.step or -1) >= 30 for r in range(4)),
                     timeout=120, interval=0.5, what="30 steps on every rank")
    await c.drill("nan", 0)
    await wait_until(lambda: c.incident(lambda i: i.status in ("resolved", "escalated"))
                     is not None, timeout=150, interval=0.5, what="the NaN's incident over")
    inc = c.incident(lambda i: i.status in ("resolved", "escalated"))
    assert inc is not None and (inc.status, inc.cause) == ("resolved", "numeric"), c.story()
    assert [(a.action, a.status) for a in inc.actions] == [("rollback", "done"),
                                                          ("restart", "skipped")], inc.actions
    assert "reload in place from memory" in inc.actions[0].detail
    assert inc.recovery is not None and (inc.recovery.path, inc.recovery.tier) == (
        "in_place", "memory"), inc.recovery
    assert not any(k.status == "committed" for k in c.observer.checkpoints
                   if inc.failure_step is None or k.step < inc.failure_step)
    # Before, nothing to roll back to meant a restart from step 0: every step so far lost.
    print(f"NaN at step {inc.failure_step} before any checkpoint: "
          f"{inc.recovery.steps_lost} step(s) lost from memory in {inc.recovery.seconds} s "
          f"(a restart from scratch: {inc.failure_step} lost)")
    await c.finished()
    survivors_kept(c, set())


async def test_two_ranks_lost_at_once_fall_back_to_the_checkpoint_and_say_why(
        cluster: InPlaceCluster) -> None:
    c = cluster
    await wait_until(lambda: any(k.status == "committed" for k in c.observer.checkpoints),
                     timeout=60, what="a committed checkpoint")
    await c.drill("kill", [2, 3])
    await wait_until(lambda: c.incident(lambda i: i.status == "resolved") is not None,
                     timeout=150, interval=0.5, what="the incident resolved")
    await c.finished()
    inc = c.incident(lambda i: i.status == "resolved")
    assert inc is not None and inc.recovery is not None, inc
    assert inc.recovery.path == "restart", inc.recovery
    assert inc.recovery.reason, inc.recovery
    # Why it restarted (the agent's word), then where it came back (the resume report).
    assert any(r.path == "restart" and r.kind != "resume" and r.reason
               and inc.recovery.reason.startswith(r.reason) for r in c.recoveries)
    assert all(len(c.pids[r]) >= 2 for r in range(4)), c.pids  # every rank restarted




async def test_an_isolated_host_leaves_and_the_survivors_go_on_smaller_in_place(
        cluster: InPlaceCluster) -> None:
    """Isolating node-b: its agent records the smaller group before its ranks stop, so
    node-a's ranks keep their processes, re-form at world size 2 (rank 0 reports the
    resize, both say hello at the new size) and finish the job; node-b exits 200."""
    c = cluster
    resize = await c.isolate_in_place("node-b")
    assert (resize.path, resize.rank, resize.world_size, resize.steps_lost) == (
        "in_place", 0, 2, 0), resize
    assert "host node-b left the job" in resize.reason and "isolated by command" in \
        resize.reason
    await wait_until(lambda: {h.rank for h in c.hellos if h.world_size == 2} == {0, 1},
                     timeout=60, interval=0.5, what="node-a's ranks at world size 2")
    await wait_until(lambda: c.procs["node-a"].poll() is not None, timeout=150,
                     interval=0.5, what="the job to finish on node-a")
    assert c.procs["node-a"].returncode == 0, c.log_tail()
    assert len(c.pids[0]) == 1 and len(c.pids[1]) == 1, c.pids  # never restarted
    assert not [r for r in c.recoveries if r.path == "restart"], c.recoveries


async def test_a_middle_host_leaves_and_the_rank_after_it_closes_up_the_gap(
        cluster: InPlaceCluster) -> None:
    """Three agents of one rank each; isolating node-b (rank 1): node-c's process goes on
    as rank 1 of 2, node-a's as rank 0, neither restarted; the detector raises nothing for
    the ranks that went (1 left, 2 renumbered) and the job finishes (a throughput drop
    may be: the job is smaller)."""
    c = cluster
    # The test's own heartbeat subscriber starts after the cluster: wait for rank 2's pid.
    moved = (await wait_until(lambda: c.pids.get(2), timeout=30, what="rank 2's pid"))[-1]
    seen = len(c.observer.anomalies)
    resize = await c.isolate_in_place("node-b")
    assert (resize.world_size, resize.steps_lost) == (2, 0), resize
    renumbered = await wait_until(lambda: [h for h in c.hellos if h.world_size == 2
                                           and h.rank == 1], timeout=60, interval=0.5,
                                  what="node-c's rank as rank 1")
    assert (renumbered[0].host, renumbered[0].pid) == ("node-c", moved)
    await wait_until(lambda: all(c.procs[h].poll() is not None for h in ("node-a", "node-c")),
                     timeout=150, interval=0.5, what="the job to finish")
    assert (c.procs["node-a"].returncode, c.procs["node-c"].returncode) == (0, 0), \
        c.log_tail()
    assert len(c.pids[0]) == 1, c.pids  # rank 0 never restarted
    assert c.pids[1][-1] == moved  # rank 1 is node-c's process now
    raised = [a for a in c.observer.anomalies[seen:]
              if a.kind in ("crash", "unresponsive", "hang", "sdc_mismatch")]
    assert [(a.kind, a.ranks) for a in raised] == [], (raised, c.hellos)


async def test_an_isolated_host_that_comes_back_is_taken_in_place(
        cluster: InPlaceCluster) -> None:
    """node-b is isolated (the group goes on at 2), unblocked and started again: its agent
    joins the next rendezvous round, node-a's ranks stay up, and the group re-forms at
    world size 4 at node-a's next command agreement, node-b's ranks taking their state
    from node-a's, and the four train on."""
    c = cluster
    await c.isolate_in_place("node-b")
    await wait_until(lambda: {h.rank for h in c.hellos if h.world_size == 2} == {0, 1},
                     timeout=60, interval=0.5, what="node-a's ranks at world size 2")
    shrunk = len(c.hellos)  # the job's first hellos were at world size 4 too
    # node-a's processes from here on (a start-up rendezvous round may have restarted them
    # once before the job ran, which is not what this test is about).
    survivors = {r: list(c.pids[r]) for r in (0, 1)}
    c.come_back("node-b")
    [grow] = await wait_until(lambda: [r for r in c.recoveries if r.kind == "grow"
                                       and r.source_rank is not None],
                              timeout=150, interval=0.5, what="the group grown in place")
    assert (grow.path, grow.rank, grow.world_size, grow.steps_lost, grow.joined) == (
        "in_place", 0, 4, 0, [2, 3]), grow
    assert "host node-b rejoined" in grow.reason, grow
    await wait_until(lambda: [r for r in c.recoveries if r.kind == "grow"
                              and r.source_rank is None], timeout=30, interval=0.5,
                     what="node-b's word as it joined")
    await wait_until(lambda: {h.rank for h in c.hellos[shrunk:] if h.world_size == 4}
                     == {0, 1, 2, 3}, timeout=60, interval=0.5,
                     what="every rank at world size 4")
    resumed = grow.resumed_step
    assert resumed is not None
    past = resumed + 10
    await wait_until(lambda: all((v := c.observer.ranks.get(r)) is not None
                                 and (v.step or -1) >= past for r in range(4)),
                     timeout=60, interval=0.5, what="the four ranks training on past it")
    assert {r: c.pids[r] for r in (0, 1)} == survivors, c.pids  # node-a never restarted
    assert not [r for r in c.recoveries if r.path == "restart"], c.recoveries
