"""Diagnosis rules, table-driven: anomaly + evidence in, cause / ranks / hosts / action out."""

from __future__ import annotations

import pytest

from trainguard.contract.evidence import (
    CheckpointSlowEvidence,
    CrashEvidence,
    DataStallEvidence,
    EccRise,
    Evidence,
    GpuHealthEvidence,
    GradExplosionEvidence,
    HangEvidence,
    NonfiniteEvidence,
    RankPhase,
    SdcMismatchEvidence,
    StragglerEvidence,
    UnresponsiveEvidence,
    XidSeen,
)
from trainguard.contract.schemas import Anomaly, GpuSample, GpuStats, WorkerExit, XidEvent
from trainguard.services.diagnoser.rules import Diagnoser, HostRecord, traceback_signature

NOW = 1_000_000.0


def anomaly(evidence: Evidence, ranks: list[int], hosts: list[str],
            ident: str = "a1") -> Anomaly:
    """An anomaly of the evidence's kind."""
    return Anomaly(id=ident, job="j", kind=evidence.KIND,  # type: ignore[arg-type]
                   ranks=ranks, hosts=hosts, step=100, onset_at=NOW - 5, detected_at=NOW - 1,
                   evidence=evidence)


def crash(rank: int, host: str, text: str, ident: str = "c1") -> Anomaly:
    return anomaly(CrashEvidence(source="worker_exit", exit_code=1, stderr_tail=text),
                   [rank], [host], ident)


def hang(ranks: list[int], hosts: list[str], ident: str = "a1", **ev: object) -> Anomaly:
    return anomaly(HangEvidence(**ev), ranks, hosts, ident)  # type: ignore[arg-type]


STUCK_IN_DATA = {"culprits": [2], "culprit_basis": "phase", "majority_phase": "comm",
                 "phases": {"2": RankPhase(phase="data", host="node-b")}}
ALL_IN_COMM = {"culprits": [], "majority_phase": "comm"}


def exit_of(rank: int, host: str, text: str, t: float, by: str | None = None) -> WorkerExit:
    return WorkerExit(id=f"e{rank}", job="j", host=host, rank=rank, exit_code=1,
                      stderr_tail=text, initiated_by=by, time=t)


def gpu(host: str, *, xid: int | None = None, ecc: int = 0, throttle: tuple[str, ...] = (),
        temp: float = 50.0, t: float = NOW - 2) -> GpuSample:
    return GpuSample(job="j", time=t, host=host, gpus=[GpuStats(
        index=0, ecc_uncorrected_volatile=ecc, throttle_reasons=list(throttle),
        temperature_c=temp)], xids=[XidEvent(gpu=0, code=xid, time=t)] if xid else [])


OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
ECC_TEXT = "RuntimeError: CUDA error: uncorrectable ECC error encountered"
TRACE = 'Traceback (most recent call last):\n  File "train.py", line 3\nKeyError: 17'

CASES: list[tuple[str, Anomaly, list[GpuSample], str, list[int], list[str], str]] = [
    ("oom text", crash(3, "node-b", OOM), [], "oom", [3], ["node-b"], "restart"),
    ("xid 79 beats the crash text", crash(3, "node-b", OOM), [gpu("node-b", xid=79)],
     "gpu_lost", [3], ["node-b"], "save_now"),
    ("ecc text", crash(2, "node-b", ECC_TEXT), [], "hbm_ecc", [2], ["node-b"], "isolate"),
    ("plain traceback", crash(1, "node-a", TRACE), [], "process_crash", [1], ["node-a"],
     "restart"),
    ("xid 64 in the exit text", crash(2, "node-b", "RuntimeError: NVRM Xid 64 on GPU 0"), [],
     "hbm_ecc", [2], ["node-b"], "isolate"),
    ("xid 95 in the exit text", crash(2, "node-b", "RuntimeError: NVRM Xid: 95"), [],
     "gpu_lost", [2], ["node-b"], "save_now"),
    ("xid 13 in the exit text is the application's", crash(2, "node-b",
                                                           "RuntimeError: NVRM Xid 13"), [],
     "process_crash", [2], ["node-b"], "restart"),
    ("gpu health xid 79", anomaly(GpuHealthEvidence(xids=[XidSeen(code=79)]), [2, 3],
                                  ["node-b"]), [], "gpu_lost", [2, 3], ["node-b"], "save_now"),
    ("gpu health xid 74 (NVLink)", anomaly(GpuHealthEvidence(xids=[XidSeen(code=74)]), [2],
                                           ["node-b"]), [], "network", [2], ["node-b"],
     "restart"),
    ("gpu health ecc rising", anomaly(GpuHealthEvidence(
        ecc_uncorrected_volatile=EccRise(from_=0, to=2)), [2], ["node-b"]), [],
     "hbm_ecc", [2], ["node-b"], "isolate"),
    ("one rank stuck in data", hang([2], ["node-a", "node-b"], **STUCK_IN_DATA), [],
     "rank_hang", [2], ["node-b"], "dump"),
    ("frozen rank", hang([1], ["node-a"], culprits=[1], culprit_basis="process_state",
                         process_states={"1": "T"}), [],
     "rank_hang", [1], ["node-a"], "dump"),
    ("everyone waits in comm (dump: the flight recorder may name a culprit)",
     hang([0, 1, 2, 3], ["node-a", "node-b"], **ALL_IN_COMM), [],
     "network", [0, 1, 2, 3], ["node-a", "node-b"], "dump"),
    ("everyone waits for data", hang([0, 1], ["node-a"], majority_phase="data"), [],
     "data_pipeline", [0, 1], ["node-a"], "alert"),
    ("NaN on all ranks", anomaly(NonfiniteEvidence(minority=False, loss={"0": float("nan")}),
                                 [0, 1, 2, 3], ["node-a", "node-b"]), [],
     "numeric", [0, 1, 2, 3], ["node-a", "node-b"], "rollback"),
    ("NaN on one rank", anomaly(NonfiniteEvidence(minority=True, nonfinite_ranks=[3]), [3],
                                ["node-b"]), [], "sdc_suspect", [3], ["node-b"], "isolate"),
    ("fingerprints disagree", anomaly(SdcMismatchEvidence(suspects=[1]), [1], ["node-a"]), [],
     "sdc_suspect", [1], ["node-a"], "isolate"),
    ("thermal straggler", anomaly(StragglerEvidence(ratio=2.0), [1], ["node-a"]),
     [gpu("node-a", throttle=("hw_thermal_slowdown",), temp=91)], "straggler_thermal", [1],
     ["node-a"], "alert"),
    ("power straggler", anomaly(StragglerEvidence(ratio=2.0), [1], ["node-a"]),
     [gpu("node-a", throttle=("hw_power_brake_slowdown",))], "straggler_power", [1],
     ["node-a"], "alert"),
    ("plain straggler", anomaly(StragglerEvidence(ratio=2.0), [1], ["node-a"]),
     [gpu("node-a")], "straggler", [1], ["node-a"], "alert"),
    ("loader stall", anomaly(DataStallEvidence(), [0], ["node-a"]), [], "data_pipeline", [0],
     ["node-a"], "alert"),
    ("slow checkpoints", anomaly(CheckpointSlowEvidence(), [0], ["node-a"]), [], "storage_io",
     [0], ["node-a"], "alert"),
    ("silence alone", anomaly(UnresponsiveEvidence(), [2], ["node-b"]), [], "unknown", [2],
     ["node-b"], "escalate"),
]


@pytest.mark.parametrize(("name", "a", "samples", "cause", "ranks", "hosts", "first"), CASES,
                         ids=[c[0] for c in CASES])
def test_causes(name: str, a: Anomaly, samples: list[GpuSample], cause: str, ranks: list[int],
                hosts: list[str], first: str) -> None:
    d = Diagnoser()
    for s in samples:
        d.observe_gpu(s)
    (diag,) = d.on_anomaly(a, NOW).publish
    assert (diag.cause, diag.ranks, diag.hosts) == (cause, ranks, hosts)
    assert diag.recommended[0] == first
    assert diag.anomaly_ids == [a.id] and 0 < diag.confidence <= 1
    assert diag.summary and diag.evidence


def test_a_rank_that_did_no_work_where_it_stopped_is_said_to_be_stuck_not_slow() -> None:
    quiet = {**STUCK_IN_DATA, "phases": {"2": RankPhase(phase="data", host="node-b",
                                                        quiet_for=1.25)}}
    (diag,) = Diagnoser().on_anomaly(hang([2], ["node-b"], **quiet), NOW).publish
    assert diag.cause == "rank_hang" and diag.ranks == [2]
    [fact] = [e for e in diag.evidence if "did no work" in e.fact]
    assert fact.value == {"2": 1.25}
    (plain,) = Diagnoser().on_anomaly(hang([2], ["node-b"], **STUCK_IN_DATA), NOW).publish
    assert not [e for e in plain.evidence if "did no work" in e.fact]


def test_crash_then_hangs_is_one_diagnosis_naming_the_crashed_host() -> None:
    d = Diagnoser()
    d.observe_exit(exit_of(3, "node-b", ECC_TEXT, NOW - 3))
    first = d.on_anomaly(crash(3, "node-b", ECC_TEXT, "crash-3"), NOW)
    (root,) = first.publish
    symptom = hang([0, 1, 2], ["node-a", "node-b"], "hang-1", **ALL_IN_COMM)
    (joined,) = d.on_anomaly(symptom, NOW + 2).publish
    assert joined.id == root.id and joined.rev == 2
    assert joined.anomaly_ids == ["crash-3", "hang-1"]
    assert joined.cause == "hbm_ecc" and joined.hosts == ["node-b"]


def test_peer_errors_are_collateral_of_the_first_exit() -> None:
    d = Diagnoser()
    d.observe_exit(exit_of(3, "node-b", OOM, NOW - 3))
    d.observe_exit(exit_of(0, "node-a", "RuntimeError: Connection closed by peer", NOW - 2))
    (root,) = d.on_anomaly(crash(3, "node-b", OOM, "c3"), NOW).publish
    (same,) = d.on_anomaly(crash(0, "node-a", "RuntimeError: Connection closed by peer",
                                 "c0"), NOW + 1).publish
    assert same.id == root.id and same.cause == "oom" and same.hosts == ["node-b"]


def test_a_lost_peer_is_no_fault_of_its_own_hosts_gpu() -> None:
    """A rank that died because another host's ranks went (isolated: their exits were the
    control plane's) names no root of its own: its host's earlier ECC drill does not make
    it ``hbm_ecc``; it joins the lost host's open root failure instead."""
    d = Diagnoser()
    d.observe_gpu(gpu("node-a", ecc=0, t=NOW - 30))
    d.observe_gpu(gpu("node-a", ecc=2, t=NOW - 20))
    (lost,) = d.on_anomaly(anomaly(GpuHealthEvidence(xids=[XidSeen(code=79)]), [2, 3],
                                   ["node-b"]), NOW - 5).publish
    d.observe_exit(exit_of(2, "node-b", "", NOW - 4, by="isolate"))
    peer = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer"
    d.observe_exit(exit_of(1, "node-a", peer, NOW - 0.1))  # its own exit, reported first
    (joined,) = d.on_anomaly(crash(1, "node-a", peer, "c1"), NOW).publish
    assert joined.id == lost.id and joined.cause == "gpu_lost", joined
    assert 1 in joined.ranks
    # With no root open it is a peer error, not the host's ECC.
    alone = Diagnoser()
    alone.observe_gpu(gpu("node-a", ecc=0, t=NOW - 30))
    alone.observe_gpu(gpu("node-a", ecc=2, t=NOW - 20))
    (guess,) = alone.on_anomaly(crash(1, "node-a", peer, "c1"), NOW).publish
    assert guess.cause == "network"
    # Its own words naming its own fault still count.
    own = alone.on_anomaly(crash(0, "node-a", ECC_TEXT, "c0"), NOW + 30).publish
    assert [x.cause for x in own if 0 in x.ranks] == ["hbm_ecc"]


def test_a_late_root_supersedes_an_earlier_guess() -> None:
    d = Diagnoser()
    (guess,) = d.on_anomaly(hang([0, 1], ["node-a"], "h", **ALL_IN_COMM), NOW).publish
    assert guess.cause == "network"
    d.observe_gpu(gpu("node-b", xid=79))
    old, root = d.on_anomaly(anomaly(GpuHealthEvidence(xids=[XidSeen(code=79)]), [2, 3],
                                     ["node-b"], "g"), NOW + 1).publish
    assert old.id == guess.id and old.status == "superseded" and old.superseded_by == root.id
    assert root.cause == "gpu_lost" and set(root.anomaly_ids) == {"g", "h"}


def test_repeated_trouble_raises_confidence_and_the_action() -> None:
    d = Diagnoser()
    a = hang([0, 1], ["node-a"], "h1", **ALL_IN_COMM)
    (fresh,) = Diagnoser().on_anomaly(a, NOW).publish
    (again,) = d.on_anomaly(a, NOW, {"node-a": HostRecord({"network": 2})}).publish
    assert again.confidence > fresh.confidence
    assert again.recommended[0] == "isolate"
    assert any(e.source == "redis:host_history" for e in again.evidence)


def test_resolved_updates_and_redeliveries_make_no_new_diagnosis() -> None:
    d = Diagnoser()
    a = crash(1, "node-a", TRACE)
    assert len(d.on_anomaly(a, NOW).publish) == 1
    assert d.on_anomaly(a, NOW + 1).publish == []
    a.status = "resolved"
    assert d.on_anomaly(a, NOW + 2).publish == []


def test_traceback_signature_ignores_numbers() -> None:
    assert traceback_signature("x\nKeyError: 17") == traceback_signature("y\nKeyError: 23")
    assert traceback_signature("KeyError: 1") != traceback_signature("ValueError: 1")
    assert traceback_signature("no exception here") == ""


def test_the_same_cause_later_is_a_new_failure() -> None:
    d = Diagnoser(same_cause_window=10)
    stuck = {"culprits": [1], "culprit_basis": "phase", "majority_phase": "comm"}
    (first,) = d.on_anomaly(hang([1], ["node-a"], "h1", **stuck), NOW).publish
    (again,) = d.on_anomaly(hang([1], ["node-a"], "h2", **stuck), NOW + 5).publish
    assert again.id == first.id  # the same failure, seen again
    (later,) = d.on_anomaly(hang([1], ["node-a"], "h3", **stuck), NOW + 30).publish
    assert later.id != first.id and later.rev == 1


def test_a_named_cause_supersedes_an_unknown_guess_on_the_same_ranks() -> None:
    d = Diagnoser()
    (guess,) = d.on_anomaly(anomaly(UnresponsiveEvidence(), [1], ["node-a"], "u1"),
                            NOW).publish
    assert guess.cause == "unknown"
    old, new = d.on_anomaly(hang([1], ["node-a"], "h1", culprits=[1],
                                 culprit_basis="process_state"), NOW + 1).publish
    assert old.id == guess.id and old.status == "superseded"
    assert new.cause == "rank_hang" and set(new.anomaly_ids) == {"u1", "h1"}


def test_a_hang_long_after_a_crash_is_its_own_failure() -> None:
    d = Diagnoser(symptom_window=20)
    d.observe_exit(exit_of(3, "node-b", TRACE, NOW - 1))
    (crashed,) = d.on_anomaly(crash(3, "node-b", TRACE, "c3"), NOW).publish
    stuck = {"culprits": [3], "culprit_basis": "phase", "majority_phase": "comm",
             "phases": {"3": RankPhase(phase="data", host="node-b")}}
    (soon,) = d.on_anomaly(hang([0, 1, 2], ["node-a"], "h1", **ALL_IN_COMM), NOW + 8).publish
    assert soon.id == crashed.id
    (later,) = d.on_anomaly(hang([3], ["node-b"], "h2", **stuck), NOW + 40).publish
    assert later.id != crashed.id and later.cause == "rank_hang"


def test_a_nan_names_the_layer_where_the_gradients_went_bad_first() -> None:
    ev = NonfiniteEvidence(nonfinite_ranks=[0, 1, 2, 3], ranks_reporting=4,
                           first_param="layers.3.attn.wq.weight", first_rank=2,
                           param_basis="backward", params_affected=9,
                           params={"2": ["layers.3.attn.wq.weight"]})
    a = anomaly(ev, [0, 1, 2, 3], ["node-a"])
    a.step = 812
    (diag,) = Diagnoser().on_anomaly(a, NOW).publish
    fact = "gradients went non-finite first in layers.3.attn.wq.weight on rank 2 at step 812"
    assert diag.cause == "numeric"
    [item] = [e for e in diag.evidence if e.source == "step_report"]
    assert item.fact == f"{fact} (9 parameters affected)"
    assert item.value == {"2": ["layers.3.attn.wq.weight"]}
    assert fact in diag.summary


@pytest.mark.parametrize(("basis", "says"), [
    ("parameter", "parameter emb.weight itself holds NaN/Inf on rank 0 at step 100"),
    ("forward", "every gradient went non-finite on rank 0 at step 100 (8 parameters): the "
                "values were bad before backward (it reached emb.weight first)"),
])
def test_how_the_first_parameter_was_chosen_shows_in_the_fact(basis: str, says: str) -> None:
    ev = NonfiniteEvidence(first_param="emb.weight", first_rank=0, param_basis=basis,
                           params_affected=8, minority=True, nonfinite_ranks=[0])
    (diag,) = Diagnoser().on_anomaly(anomaly(ev, [0], ["node-a"]), NOW).publish
    assert diag.cause == "sdc_suspect" and says in [e.fact for e in diag.evidence]


def test_an_explosion_names_the_largest_gradients() -> None:
    ev = GradExplosionEvidence(grad_norm=500.0, baseline_median=2.0, top_rank=1,
                               top_params={"layers.1.mlp.w1.weight": 480.0, "head.weight": 3.5})
    (diag,) = Diagnoser().on_anomaly(anomaly(ev, [1], ["node-a"]), NOW).publish
    assert diag.cause == "numeric"
    assert ("largest gradients in layers.1.mlp.w1.weight (norm 480), head.weight (norm 3.5) "
            "on rank 1 at step 100") in diag.summary


def test_numeric_evidence_without_names_adds_no_fact() -> None:
    for ev in (NonfiniteEvidence(), GradExplosionEvidence()):
        (diag,) = Diagnoser().on_anomaly(anomaly(ev, [0], ["node-a"]), NOW).publish
        assert all(e.source != "step_report" for e in diag.evidence)


def test_a_diagnosis_says_whether_a_worker_ended() -> None:
    """The remediator waits for a launcher's own restart only after a worker ended: an ECC
    rise read from NVML ends none; an ECC error a rank died of does, joined or not."""
    d = Diagnoser()
    (read,) = d.on_anomaly(anomaly(GpuHealthEvidence(
        ecc_uncorrected_volatile=EccRise(from_=0, to=2)), [1], ["node-a"], "g1"), NOW).publish
    assert read.cause == "hbm_ecc" and not read.worker_exited
    d.observe_exit(exit_of(1, "node-a", ECC_TEXT, NOW))
    (died,) = d.on_anomaly(crash(1, "node-a", ECC_TEXT, "c1"), NOW + 1).publish
    assert died.id == read.id and died.worker_exited
    other = Diagnoser()
    other.observe_exit(exit_of(3, "node-b", ECC_TEXT, NOW - 3))
    (crashed,) = other.on_anomaly(crash(3, "node-b", ECC_TEXT), NOW).publish
    assert crashed.cause == "hbm_ecc" and crashed.worker_exited


def test_a_hang_right_after_its_crash_was_recovered_is_its_own_failure() -> None:
    """Rank 1 crashed and was replaced in place (the detector resolved the crash); its new
    process hangs two seconds later. That hang is no symptom of the crash: joined to it,
    the old recovery's report resolved the new incident and nothing acted on the hang."""
    d = Diagnoser(symptom_window=20)
    d.observe_exit(exit_of(1, "node-a", TRACE, NOW - 1))
    crashed = crash(1, "node-a", TRACE, "c1")
    (root,) = d.on_anomaly(crashed, NOW).publish
    crashed.status = "resolved"
    d.on_anomaly(crashed, NOW + 2)
    stuck = {"culprits": [1], "culprit_basis": "process_state", "majority_phase": "comm"}
    (hung,) = d.on_anomaly(hang([1], ["node-a"], "h1", **stuck), NOW + 4).publish
    assert hung.id != root.id and hung.cause == "rank_hang" and hung.anomaly_ids == ["h1"]
