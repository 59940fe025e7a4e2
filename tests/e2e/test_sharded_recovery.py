"""Sharded jobs end to end: an FSDP2 trainer (the toy trainer's ``--parallel fsdp``, AdamW,
the in-place API as the README shows it) under ``trainguard up`` and two ``trainguard
launch`` agents, 4 gloo ranks, fingerprints every 5 steps.

* Healthy, it raises no ``sdc_mismatch``: the ranks hold different shards, and no two
  hold the same, so there is nothing to compare (the client says so and sends none).
* A crashed rank cannot be replaced in place (no peer holds its shard): the agent restarts
  the group at once, the group resumes from the committed checkpoint (never from step 0),
  the incident says why and where it came back, and the job ends with the parameters of
  an uninterrupted run.
* A hung rank is acted on the same way: the group restarts from the committed checkpoint.
* FSDP with buddy copies (``--buddy``, a memory snapshot every K steps): a crashed rank is
  replaced in place, every rank back in memory (at most K steps lost), the replacement's
  shard from its buddy on the other host; with the buddy's memory gone bad (the
  ``corrupt_copies`` drill) the copy fails its check and every rank loads the committed
  checkpoint in place, the incident saying why. Both end with the parameters of an
  uninterrupted run.
* HSDP (``--parallel hsdp``: 2 replicas of 2-rank shard groups, the model built by
  ``trainguard.torch.fsdp``): a crashed rank is replaced in place, its shard handed over by
  the rank of the other replica that holds the same; the survivors keep their processes,
  nothing is lost, and the job ends with the parameters of an uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import wait_until
from tests.e2e.conftest import job_env, torchrun
from tests.e2e.test_in_place import InPlaceCluster, survivors_kept
from trainguard.contract.schemas import Incident, RecoveryReport
from trainguard.contract.timeline import RESTART_PHASES

pytestmark = pytest.mark.timeout(480)
STEPS = 100
SHARDED = ["--parallel", "fsdp", "--optimizer", "adamw", "--sync-every", "1000",
           "--pg-timeout", "30"]


BUDDY_K = 5
BUDDY = [*SHARDED, "--buddy", "--memory-snapshots", str(BUDDY_K)]
"""FSDP2 with a memory snapshot every K steps, copied to a buddy rank on the other host."""
HYBRID = ["--parallel", "hsdp", *SHARDED[2:]]
HYBRID_OFTEN_SYNC = [*HYBRID[:4], "--sync-every", "5", "--pg-timeout", "30"]
"""A host taken back joins at the running ranks' next command agreement."""


@pytest.fixture
async def cluster(tmp_path: Path, job: str, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    name = request.node.name
    back = "comes_back" in name  # long enough for a host to leave and come back
    trainer = (HYBRID_OFTEN_SYNC if back else HYBRID) if "hsdp" in name else \
        BUDDY if "buddy" in name else SHARDED
    # The buddy test's run saves nothing to disk: a checkpoint newer than the newest
    # snapshot every rank holds is rightly preferred, which made its tier a matter of timing
    # (the corrupted-copy test covers the disk).
    c = InPlaceCluster(tmp_path, job, trainer, steps=100_000 if back else STEPS,
                       **({"ckpt_every": 100_000} if "from_its_buddy" in name else {}))
    try:
        await c.start(timeout=180)
        await c.watch()
        yield c
    finally:
        await c.stop()


def uninterrupted(tmp_path: Path, nats_url: str, prefix: str,
                  trainer: list[str] = SHARDED) -> dict[str, torch.Tensor]:
    out, log = tmp_path / "baseline.pt", tmp_path / "baseline.log"
    proc = torchrun(4, ["--job", "baseline", "--model", "tiny", "--steps", str(STEPS),
                        "--step-time", "0.0", "--in-place", "--final-params", str(out),
                        "--seed", "3", *trainer], job_env(nats_url, prefix), log)
    assert proc.wait(180) == 0, log.read_text()[-3000:]
    state: dict[str, torch.Tensor] = torch.load(out, weights_only=True)
    return state


async def committed(c: InPlaceCluster, step: int = 0) -> None:
    await wait_until(lambda: any(k.status == "committed" and k.step >= step
                                 for k in c.observer.checkpoints),
                     timeout=120, what=f"a committed checkpoint at step {step} or later")


async def replaced_in_place(c: InPlaceCluster, rank: int) -> tuple[Incident, RecoveryReport]:
    """Kill ``rank``; once the job finished, the incident and the re-formed group's report
    of a replacement in place, the survivors' processes kept."""
    await c.drill("kill", rank)
    await wait_until(lambda: c.incident(lambda i: i.status == "resolved") is not None,
                     timeout=180, interval=0.5, what="the incident resolved")
    await c.finished(timeout=240)
    inc = c.incident(lambda i: i.status == "resolved")
    assert inc is not None and inc.cause == "process_crash", inc
    assert inc.recovery is not None and inc.recovery.path == "in_place", inc.recovery
    survivors_kept(c, {rank})
    [done] = [r for r in c.recoveries if r.path == "in_place" and r.kind == "replace"
              and r.source_rank is not None]
    assert done.joined == [rank], done
    return inc, done


def same_as_uninterrupted(c: InPlaceCluster, tmp_path: Path, nats_url: str, prefix: str,
                          trainer: list[str] = SHARDED) -> None:
    final: dict[str, torch.Tensor] = torch.load(c.final, weights_only=True)
    baseline = uninterrupted(tmp_path, nats_url, prefix, trainer)
    assert final.keys() == baseline.keys()
    assert [k for k, v in baseline.items() if not torch.equal(final[k], v)] == []


def no_false_sdc(c: InPlaceCluster) -> None:
    assert [a for a in c.observer.anomalies if a.kind == "sdc_mismatch"] == []
    assert c.observer.fingerprints == {}  # no replicas: nothing sent, nothing to compare


async def test_a_crashed_fsdp_rank_restarts_the_group_from_the_checkpoint_at_once(
        cluster: InPlaceCluster, tmp_path: Path, nats_url: str, prefix: str) -> None:
    c = cluster
    # The coordinator's interval (hundreds of steps here) replaces the default of every 10
    # as soon as the first checkpoint commits: that one may be the only one before the kill.
    await committed(c, 9)
    at = max(k.step for k in c.observer.checkpoints if k.status == "committed")
    await c.drill("kill", 2)
    await wait_until(lambda: c.incident(lambda i: i.status == "resolved") is not None,
                     timeout=180, interval=0.5, what="the incident resolved")
    inc = c.incident(lambda i: i.status == "resolved")
    assert inc is not None and inc.cause == "process_crash", inc
    assert inc.recovery is not None and inc.recovery.path == "restart", inc.recovery
    # Why it restarted (the agent's word, and the survivors'), then where it came back.
    assert "sharded" in inc.recovery.reason and "loaded step" in inc.recovery.reason
    assert any("no other rank holds rank 2's state" in r.reason for r in c.recoveries
               if r.path == "restart" and r.kind == "replace"), c.recoveries
    [resume] = [r for r in c.recoveries if r.kind == "resume"]
    assert resume.resumed_step >= at + 1  # from the committed checkpoint, not from step 0
    # The way back, from the agent's word of the failure to the first step, in order.
    assert list(resume.phases) == list(RESTART_PHASES), resume.phases
    assert resume.seconds == pytest.approx(sum(resume.phases.values()), abs=1e-3)
    assert "rank(s) on its host warm" in resume.reason
    assert inc.recovery.phases == resume.phases
    await c.finished(timeout=240)
    no_false_sdc(c)
    assert all(len(c.pids[r]) == 2 for r in range(4)), c.pids  # the group restarted once
    same_as_uninterrupted(c, tmp_path, nats_url, prefix)


@pytest.mark.timeout(420)  # the cluster, the recovery, then the uninterrupted run
async def test_a_crashed_fsdp_rank_takes_its_shard_from_its_buddy_in_place(
        cluster: InPlaceCluster, tmp_path: Path, nats_url: str, prefix: str) -> None:
    c = cluster
    await wait_until(lambda: c.observer.max_step >= 20, timeout=120, what="step 20")
    _, done = await replaced_in_place(c, 2)  # its buddy is rank 0, on the other host
    # Every rank went back in memory to the newest step whose every shard is held, the
    # replacement's from its buddy: no disk read, at most K steps lost.
    assert done.tier == "memory" and "shards from memory" in done.reason, done
    assert 0 <= done.steps_lost <= BUDDY_K, done
    assert not [r for r in c.recoveries if r.path == "restart"], c.recoveries
    same_as_uninterrupted(c, tmp_path, nats_url, prefix)


@pytest.mark.timeout(420)
async def test_a_corrupted_buddy_copy_sends_the_fsdp_group_to_the_disk_in_place(
        cluster: InPlaceCluster, tmp_path: Path, nats_url: str, prefix: str) -> None:
    c = cluster
    await committed(c, 9)
    await c.drill("corrupt_copies", 0)  # rank 0 holds rank 2's copies: its memory goes bad
    await wait_until(lambda: any(a.kind == "corrupt_copies" and a.outcome == "done"
                                 for a in c.acks), timeout=60, what="the copies corrupted")
    inc, done = await replaced_in_place(c, 2)
    # The copy failed its check on the replacement: every rank took the committed
    # checkpoint instead, in place, and the incident says why.
    assert done.tier == "disk", done
    assert "rank 0's copy" in done.reason and "failed its checksum" in done.reason, done
    assert inc.recovery is not None and "failed its checksum" in inc.recovery.reason
    same_as_uninterrupted(c, tmp_path, nats_url, prefix)


async def test_a_hung_fsdp_rank_is_acted_on(cluster: InPlaceCluster) -> None:
    c = cluster
    await committed(c)
    await c.drill("hang", 1, phase="data", seconds=3600)
    await wait_until(lambda: c.incident(lambda i: i.status == "resolved") is not None,
                     timeout=180, interval=0.5, what="the hang's incident resolved")
    inc = c.incident(lambda i: i.status == "resolved")
    assert inc is not None and inc.cause == "rank_hang", inc
    restart = next(a for a in inc.actions if a.action == "restart")
    assert restart.status == "done" and "cannot be replaced in place" in restart.detail, restart
    assert "no other rank holds rank 1's state" in restart.detail
    assert inc.recovery is not None and inc.recovery.kind == "resume", inc.recovery
    await c.finished(timeout=240)
    no_false_sdc(c)


async def test_a_crashed_hsdp_rank_takes_its_shard_from_its_replica_in_place(
        cluster: InPlaceCluster, tmp_path: Path, nats_url: str, prefix: str) -> None:
    c = cluster
    await wait_until(lambda: c.observer.max_step >= 20, timeout=120, what="step 20")
    inc, done = await replaced_in_place(c, 2)  # shard 0 of replica 1: rank 0 holds the same
    assert inc.recovery is not None and inc.steps_lost == 0, inc
    # Where the time went, as rank 0 saw it, in order.
    assert list(inc.recovery.phases) == ["seen", "release", "teardown", "replacement",
                                         "gathered", "formed", "rebuilt", "agreed", "state",
                                         "after"], inc.recovery.phases
    assert all(v >= 0 for v in inc.recovery.phases.values())
    # Inside "replacement": the failed rank's agent, from its exit found to the spare.
    assert list(inc.recovery.agent_phases) == ["decision", "generation", "spare"], \
        inc.recovery.agent_phases
    assert done.source_rank == 0 and done.steps_lost == 0, done
    assert not [r for r in c.recoveries if r.path == "restart"], c.recoveries
    # Replicas agree, so the fingerprints of each shard's replica group are compared.
    assert [a for a in c.observer.anomalies if a.kind == "sdc_mismatch"] == []
    same_as_uninterrupted(c, tmp_path, nats_url, prefix, HYBRID)


async def test_an_hsdp_replica_host_that_leaves_and_comes_back_stays_in_place(
        cluster: InPlaceCluster) -> None:
    """HSDP 2x2, node-b holding the second replica. Isolated, it leaves node-a's replica
    with every shard: node-a's ranks re-mesh at 1x2 and go on in place. Started again, its
    ranks take their shards from node-a's and the group re-forms at 2x2, node-a's
    processes untouched; the replicas then agree (fingerprints, no sdc_mismatch)."""
    c = cluster
    resize = await c.isolate_in_place("node-b")
    assert (resize.path, resize.world_size, resize.steps_lost) == ("in_place", 2, 0), resize
    await wait_until(lambda: {h.rank for h in c.hellos if h.world_size == 2} == {0, 1},
                     timeout=60, interval=0.5, what="node-a's ranks at world size 2")
    shrunk = len(c.hellos)
    survivors = {r: list(c.pids[r]) for r in (0, 1)}
    c.come_back("node-b")
    [grow] = await wait_until(lambda: [r for r in c.recoveries if r.kind == "grow"
                                       and r.source_rank is not None],
                              timeout=150, interval=0.5, what="the group grown in place")
    assert (grow.path, grow.world_size, grow.steps_lost, grow.joined) == (
        "in_place", 4, 0, [2, 3]), grow
    await wait_until(lambda: {h.rank for h in c.hellos[shrunk:] if h.world_size == 4}
                     == {0, 1, 2, 3}, timeout=60, interval=0.5,
                     what="every rank at world size 4")
    assert grow.resumed_step is not None
    past = grow.resumed_step + 12
    await wait_until(lambda: all((v := c.observer.ranks.get(r)) is not None
                                 and (v.step or -1) >= past for r in range(4)),
                     timeout=90, interval=0.5, what="the four ranks training on past it")
    # node-a's processes never restarted nor were replaced
    assert {r: c.pids[r] for r in (0, 1)} == survivors, (
        c.pids, [(r.kind, r.path, r.reason, r.joined) for r in c.recoveries], c.story(),
        c.log_tail())
    assert not [r for r in c.recoveries if r.path == "restart"], c.recoveries
    # Each shard's two replicas (ranks 0 and 2, 1 and 3) hold the same state after the grow.
    after = await wait_until(lambda: [sums for step, sums in c.observer.fingerprints.items()
                                      if step > grow.resumed_step and len(sums) == 4],
                             timeout=60, interval=0.5, what="fingerprints after the grow")
    assert all(sums[0] == sums[2] and sums[1] == sums[3] for sums in after), after
    assert [a for a in c.observer.anomalies if a.kind == "sdc_mismatch"] == []
