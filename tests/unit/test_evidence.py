"""Anomaly evidence: one Struct per kind, typed by ``kind`` on decode, tolerant on the wire."""

from __future__ import annotations

import math
from typing import get_args

import msgspec
import pytest

from trainguard.contract import evidence as ev
from trainguard.contract.codec import decode_durable, encode_durable
from trainguard.contract.errors import DecodeError
from trainguard.contract.schemas import Anomaly, AnomalyKind


def body(kind: str, evidence: object) -> bytes:
    return msgspec.json.encode({"schema": "io.trainguard.anomaly.v1", "id": "a", "job": "j",
                                "kind": kind, "onset_at": 1.0, "detected_at": 2.0,
                                "evidence": evidence})


def test_every_anomaly_kind_has_its_own_evidence_struct() -> None:
    assert set(ev.BY_KIND) == set(get_args(AnomalyKind))
    assert len(set(ev.BY_KIND.values())) == len(ev.BY_KIND)


@pytest.mark.parametrize("kind", sorted(ev.BY_KIND))
def test_each_kind_round_trips_as_its_struct(kind: str) -> None:
    a = Anomaly(id="a", job="j", kind=kind, onset_at=1.0,  # type: ignore[arg-type]
                detected_at=2.0)
    assert type(a.evidence) is ev.BY_KIND[kind]  # no evidence given: the kind's empty one
    back = decode_durable(encode_durable(a), Anomaly)
    assert type(back.evidence) is ev.BY_KIND[kind] and back == a


def test_json_names_are_the_detectors_keys() -> None:
    a = Anomaly(id="a", job="j", kind="gpu_health", onset_at=1.0, detected_at=2.0,
                evidence=ev.GpuHealthEvidence(host="h", gpu_index=0,
                                              ecc_uncorrected_volatile=ev.EccRise(from_=1, to=3)))
    wire = msgspec.json.decode(encode_durable(a))["evidence"]
    assert wire["ecc_uncorrected_volatile"] == {"from": 1, "to": 3}
    assert {"host", "gpu_index", "xids", "gpu", "fatal_xids"} <= set(wire)


def test_an_old_or_newer_writers_evidence_still_decodes() -> None:
    """Keys missing (older detector) take defaults; unknown keys (newer one) are ignored."""
    a = decode_durable(body("hang", {"culprits": [2], "stalled_since": "nan",
                                     "phases": {"2": {"phase": "data", "future": 1}},
                                     "added_later": {"x": 1}}), Anomaly)
    assert isinstance(a.evidence, ev.HangEvidence)
    assert a.evidence.culprits == [2] and a.evidence.phases["2"].phase == "data"
    assert a.evidence.stalled_since is not None and math.isnan(a.evidence.stalled_since)
    assert a.evidence.majority_phase == "" and a.evidence.resumed_step is None
    empty = decode_durable(body("crash", {}), Anomaly)
    assert empty.evidence == ev.CrashEvidence()


@pytest.mark.parametrize(("evidence", "why"), [
    ({"culprits": "two"}, r"evidence of a hang anomaly: Expected `array`.*culprits"),
    ([1, 2], r"evidence of a hang anomaly must be an object"),
    ("x", r"evidence of a hang anomaly must be an object"),
])
def test_evidence_of_the_wrong_shape_is_a_decode_error(evidence: object, why: str) -> None:
    with pytest.raises(DecodeError, match=why):
        decode_durable(body("hang", evidence), Anomaly)


def test_evidence_must_be_the_kinds_struct() -> None:
    with pytest.raises(TypeError, match=r"evidence of a hang anomaly must be .* HangEvidence"):
        Anomaly(id="a", job="j", kind="hang", onset_at=1.0, detected_at=2.0,
                evidence=ev.CrashEvidence())
    a = Anomaly(id="a", job="j", kind="hang", onset_at=1.0, detected_at=2.0)
    with pytest.raises(TypeError):
        msgspec.structs.replace(a, kind="crash")  # the evidence would no longer fit


def test_evidence_matches_by_type() -> None:
    a = Anomaly(id="a", job="j", kind="straggler", onset_at=1.0, detected_at=2.0,
                evidence=ev.StragglerEvidence(ratio=1.5))
    match a.evidence:
        case ev.StragglerEvidence(ratio=ratio):
            assert ratio == 1.5
        case _:
            pytest.fail("straggler evidence")
    rises = ev.GpuHealthEvidence(ecc_uncorrected_aggregate=ev.EccRise(from_=1, to=2)).ecc_rises()
    assert rises == {"ecc_uncorrected_aggregate": ev.EccRise(from_=1, to=2)}
