"""Non-finite values, gradient and loss anomalies, SDC fingerprints and GPU health."""

from __future__ import annotations

import math

import msgspec

from trainguard.contract.evidence import EccRise
from trainguard.contract.schemas import Fingerprint, GpuSample, GpuStats, RankHello, XidEvent
from trainguard.services.detector.synthetic import Harness, SimConfig
from trainguard.services.detector.thresholds import Thresholds


def harness(ranks: int = 8, **cfg: object) -> Harness:
    return Harness(Thresholds(), SimConfig(ranks=ranks, **cfg))  # type: ignore[arg-type]


def test_nan_loss_on_every_rank_is_nonfinite_at_that_step() -> None:
    h = harness()
    h.sim.steps(30)
    h.sim.nan_ranks[33] = set(range(8))
    h.sim.steps(5)
    [bad] = h.opened()
    assert bad.kind == "nonfinite" and bad.step == 33 and bad.ranks == list(range(8))
    assert bad.evidence.minority is False and bad.severity == "critical"
    assert math.isnan(bad.evidence.loss["0"])
    assert bad.detected_at - bad.onset_at < 1.0, "judged when the step's reports are in"
    h.sim.steps(25)
    assert [a.id for a in h.resolved()] == [bad.id]


def test_nan_on_a_minority_of_ranks_says_so_as_an_sdc_hint() -> None:
    h = harness()
    h.sim.steps(10)
    h.sim.nan_ranks[12] = {2}
    h.sim.steps(5)
    [bad] = h.opened()
    assert bad.ranks == [2] and bad.evidence.minority is True
    assert bad.evidence.sdc_hint is True and bad.evidence.ranks_reporting == 8


def test_nan_that_persists_is_one_anomaly() -> None:
    h = harness()
    h.sim.steps(10)
    for s in range(12, 40):
        h.sim.nan_ranks[s] = set(range(8))
    h.sim.steps(40)
    assert len(h.opened()) == 1 and h.resolved() == []


def test_gradient_explosion_after_warm_up_not_during_it() -> None:
    h = harness()
    h.sim.grad_scale[10] = 100.0  # warm-up: no baseline yet, no judgement
    h.sim.steps(80)
    assert h.events == []
    h.sim.grad_scale[90] = 50.0
    h.sim.steps(15)
    [boom] = h.opened()
    assert boom.kind == "grad_explosion" and boom.step == 90
    assert boom.evidence.z > 6 and boom.evidence.grad_norm > 10 * boom.evidence.baseline_median
    h.sim.steps(25)
    assert [a.kind for a in h.resolved()] == ["grad_explosion"]


def test_vanishing_gradients_need_a_few_steps() -> None:
    h = harness()
    h.sim.steps(80)
    h.sim.grad_scale[81] = 1e-4
    h.sim.steps(5)
    assert h.events == [], "one tiny norm is not vanishing"
    for s in range(90, 96):
        h.sim.grad_scale[s] = 1e-4
    h.sim.steps(10)
    [gone] = h.opened()
    assert gone.kind == "grad_vanishing" and gone.step == 92


def test_loss_spike_against_the_rolling_baseline() -> None:
    h = harness()
    h.sim.steps(120)
    h.sim.loss_scale[125] = 2.0
    h.sim.steps(10)
    [spike] = h.opened()
    assert spike.kind == "loss_spike" and spike.step == 125
    assert spike.evidence.loss > 1.3 * spike.evidence.baseline_median


def fp(rank: int, step: int, checksum: int, time: float, group: str = "dp",
       group_size: int = 0) -> Fingerprint:
    return Fingerprint(job="sim", time=time, rank=rank, step=step, checksum=checksum,
                       group=group, group_size=group_size)


def test_fingerprint_minority_is_the_sdc_suspect_and_agreement_resolves() -> None:
    h = harness(ranks=4, fingerprint_every=50)
    h.sim.steps(60)
    h.sim.fp_flip[100] = {2}
    h.sim.steps(50)
    [sdc] = h.opened()
    # found at step 100, after the round of step 50 agreed: the corruption may be in any
    # step from 51, so a rollback goes below that
    assert sdc.kind == "sdc_mismatch" and sdc.ranks == [2] and sdc.step == 51
    assert (sdc.evidence.found_step, sdc.evidence.agreed_step) == (100, 50)
    assert sdc.evidence.suspects == [2] and sdc.evidence.tie is False
    h.sim.steps(50)
    [resolved] = h.resolved()
    assert resolved.id == sdc.id and resolved.evidence.agreed_step == 150


def test_fingerprint_tie_names_no_suspect() -> None:
    h = harness(ranks=2)
    h.sim.steps(5)
    t = h.clock
    for rank, checksum in ((0, 11), (1, 12)):
        h.feed(fp(rank, 10, checksum, t))
    [sdc] = h.opened()
    assert sdc.evidence.tie is True and sdc.evidence.suspects == []
    assert sdc.ranks == [0, 1]


def test_fingerprints_of_separate_groups_are_compared_within_each_group() -> None:
    h = harness(ranks=4)
    h.sim.steps(5)
    t = h.clock
    for rank, group, checksum in ((0, "dp0", 5), (1, "dp0", 5), (2, "dp1", 7), (3, "dp1", 7)):
        h.feed(fp(rank, 10, checksum, t, group))
    h.tick(t + 10.0)
    assert h.opened("sdc_mismatch") == []


def test_a_shard_s_replicas_are_judged_as_soon_as_both_reported() -> None:
    """HSDP, 2 replicas x 2 shards: the shards hold different parameters (no anomaly), and
    a flip in one replica is seen once its two holders reported, not at the job's size."""
    h = harness(ranks=4)
    h.sim.steps(5)
    t = h.clock
    for rank, checksum in ((0, 5), (2, 5), (1, 7), (3, 7)):
        h.feed(fp(rank, 10, checksum, t, f"shard={rank % 2}", group_size=2))
    assert h.opened("sdc_mismatch") == []
    h.feed(fp(1, 20, 7, t + 1.0, "shard=1", group_size=2))
    h.feed(fp(3, 20, 8, t + 1.0, "shard=1", group_size=2))  # no tick: the round is complete
    [sdc] = h.opened("sdc_mismatch")
    assert sdc.ranks == [1, 3] and sdc.evidence.group == "shard=1" and sdc.evidence.tie


def test_fatal_xid_is_gpu_health_naming_host_and_the_rank_on_that_gpu() -> None:
    h = harness(ranks=4, ranks_per_host=2)
    for rank in range(4):
        h.detector.on_hello(RankHello(job="sim", rank=rank, world_size=4, local_rank=rank % 2,
                                      host=f"node-{rank // 2}"), h.clock)
    h.sim.steps(5)
    sample = GpuSample(job="sim", time=h.clock, host="node-1",
                       gpus=[GpuStats(index=0), GpuStats(index=1, uuid="GPU-b")],
                       xids=[XidEvent(gpu=1, code=79, time=h.clock, detail="fell off the bus"),
                             XidEvent(gpu=0, code=13, time=h.clock)])
    h.feed(sample)
    h.feed(sample)  # the same XID reported again is the same event
    [gpu] = h.opened()
    assert gpu.kind == "gpu_health" and gpu.hosts == ["node-1"] and gpu.ranks == [3]
    assert gpu.evidence.xids[0].code == 79 and gpu.evidence.gpu.uuid == "GPU-b"
    assert len(h.events) == 1


def test_rising_uncorrectable_ecc_is_gpu_health_a_steady_count_is_not() -> None:
    h = harness(ranks=2)
    h.sim.steps(3)

    def sample(count: int) -> GpuSample:
        return GpuSample(job="sim", time=h.clock, host="node-0",
                         gpus=[GpuStats(index=0, ecc_uncorrected_aggregate=count)])

    h.feed(sample(4))
    h.feed(sample(4))
    assert h.events == []
    h.feed(sample(6))
    [gpu] = h.opened()
    assert gpu.evidence.ecc_uncorrected_aggregate == EccRise(from_=4, to=6)
    assert msgspec.to_builtins(gpu.evidence)["ecc_uncorrected_aggregate"] == {"from": 4, "to": 6}


def test_nonfinite_evidence_names_where_the_gradients_went_bad_first() -> None:
    h = harness(ranks=4)
    h.sim.steps(10)
    h.sim.report_fields[12] = {r: {
        "grad_norm": math.nan, "nonfinite": 1, "nonfinite_count": 6, "nonfinite_basis": "backward",
        "nonfinite_params": ["layers.3.attn.wq.weight", "layers.3.attn.wq.bias"]}
        for r in (2, 3)}
    h.sim.nan_ranks[12] = {0, 1}  # a NaN loss only: these ranks name no parameter
    h.sim.steps(5)
    [bad] = h.opened()
    ev = bad.evidence
    assert bad.kind == "nonfinite" and bad.ranks == [0, 1, 2, 3]
    assert (ev.first_param, ev.first_rank, ev.param_basis, ev.params_affected) == (
        "layers.3.attn.wq.weight", 2, "backward", 6)
    assert ev.params == {"2": ["layers.3.attn.wq.weight", "layers.3.attn.wq.bias"],
                         "3": ["layers.3.attn.wq.weight", "layers.3.attn.wq.bias"]}
    wire = msgspec.json.decode(msgspec.json.encode(bad))["evidence"]
    assert wire["first_param"] == "layers.3.attn.wq.weight" and wire["first_rank"] == 2


def test_nonfinite_evidence_without_named_parameters_keeps_its_old_shape() -> None:
    h = harness()
    h.sim.steps(10)
    h.sim.nan_ranks[12] = set(range(8))
    h.sim.steps(3)
    [bad] = h.opened()
    assert bad.evidence.first_param == "" and bad.evidence.first_rank is None
    assert bad.evidence.params == {}


def test_gradient_explosion_evidence_names_the_largest_gradients() -> None:
    h = harness(ranks=4)
    h.sim.steps(80)
    h.sim.grad_scale[90] = 50.0
    top = {"layers.1.mlp.w1.weight": 900.0, "layers.1.mlp.w2.weight": 40.0,
           "layers.0.attn.wq.weight": 3.0}
    h.sim.report_fields[90] = {1: {"spike_params": top}}
    h.sim.steps(15)
    [boom] = h.opened()
    assert boom.kind == "grad_explosion" and boom.step == 90
    assert boom.evidence.top_rank == 1 and boom.evidence.top_params == top
    assert list(boom.evidence.top_params) == list(top), "largest first, as the rank sent it"
