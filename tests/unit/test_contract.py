"""The message contract: round trips, rejections with a reason, and subject names."""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.samples import DURABLE, TELEMETRY
from trainguard.contract import schemas
from trainguard.contract.codec import (
    MAX_TELEMETRY_BYTES,
    decode_any_durable,
    decode_durable,
    decode_telemetry,
    encode_durable,
    encode_telemetry,
)
from trainguard.contract.errors import DecodeError, InvalidToken
from trainguard.contract.subjects import Subjects


def _same(a: object, b: object) -> bool:
    """Equality where NaN equals NaN and non-finite strings in free-form dicts count."""
    ba, bb = msgspec.to_builtins(a), msgspec.to_builtins(b)

    def norm(v: object) -> object:
        if isinstance(v, float) and math.isnan(v):
            return "nan"
        if isinstance(v, float) and math.isinf(v):
            return "inf" if v > 0 else "-inf"
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        if isinstance(v, list):
            return [norm(x) for x in v]
        return v

    return norm(ba) == norm(bb)


def test_every_type_has_a_sample() -> None:
    assert {type(m) for m in DURABLE} == set(schemas.DURABLE_TYPES)
    assert {type(m) for m in TELEMETRY} == set(schemas.TelemetryMessage.__args__)


@pytest.mark.parametrize("msg", TELEMETRY, ids=lambda m: type(m).__name__)
def test_telemetry_round_trips(msg: schemas.TelemetryMessage) -> None:
    back = decode_telemetry(encode_telemetry(msg))
    assert type(back) is type(msg)
    assert _same(back, msg)


@pytest.mark.parametrize("msg", DURABLE, ids=lambda m: type(m).__name__)
def test_durable_round_trips_with_nonfinite_floats(msg: schemas.Durable) -> None:
    data = encode_durable(msg)
    back = decode_any_durable(data, msg.ce_type())
    assert type(back) is type(msg)
    assert back.schema == msg.ce_type() == f"io.trainguard.{msg.KIND}.v1"
    assert _same(back, msg)


def test_nonfinite_floats_travel_as_strings() -> None:
    anomaly = next(m for m in DURABLE if isinstance(m, schemas.Anomaly))
    assert b'"loss":"nan"' in encode_durable(anomaly)
    report = schemas.CheckpointReport(id="r", job="j", rank=0, step=1, path="p", world_size=1,
                                      seconds_total=float("inf"))
    back = decode_durable(encode_durable(report), schemas.CheckpointReport)
    assert back.seconds_total == math.inf


def test_wrong_field_type_is_named() -> None:
    data = b'{"schema":"io.trainguard.anomaly.v1","id":"a","job":"j","kind":"hang",' \
           b'"onset_at":"yesterday","detected_at":1}'
    with pytest.raises(DecodeError, match=r"onset_at"):
        decode_durable(data, schemas.Anomaly)


def test_missing_field_is_named() -> None:
    with pytest.raises(DecodeError, match=r"kind"):
        decode_durable(b'{"schema":"io.trainguard.anomaly.v1","id":"a","job":"j",'
                       b'"onset_at":1,"detected_at":1}', schemas.Anomaly)


def test_unknown_enum_value_is_rejected() -> None:
    with pytest.raises(DecodeError, match=r"kind"):
        decode_durable(b'{"schema":"io.trainguard.anomaly.v1","id":"a","job":"j",'
                       b'"kind":"meteor","onset_at":1,"detected_at":1}', schemas.Anomaly)


def test_unknown_version_is_rejected() -> None:
    msg = DURABLE[0]
    with pytest.raises(DecodeError, match=r"unknown message type or version"):
        decode_any_durable(encode_durable(msg), "io.trainguard.rank_hello.v9")
    body = encode_durable(msg).replace(b".v1", b".v2")
    with pytest.raises(DecodeError, match=r"unsupported schema"):
        decode_any_durable(body, msg.ce_type())
    with pytest.raises(DecodeError, match=r"missing ce-type"):
        decode_any_durable(encode_durable(msg), None)


def test_unknown_telemetry_tag_is_rejected() -> None:
    data = msgspec.msgpack.encode({"t": "hb.v7", "job": "j", "time": 1.0, "rank": 0})
    with pytest.raises(DecodeError, match=r"hb.v7"):
        decode_telemetry(data)


def test_new_fields_from_a_newer_writer_are_tolerated() -> None:
    data = msgspec.msgpack.encode({"t": "hb.v1", "job": "j", "time": 1.0, "rank": 0,
                                   "future_field": [1, 2]})
    assert decode_telemetry(data).job == "j"


def test_oversized_payloads_are_rejected() -> None:
    big = schemas.StepReport(job="j", time=1.0, rank=0, step=1,
                             nonfinite_params=["p" * 1000] * 100)
    with pytest.raises(DecodeError, match=r"exceeds"):
        decode_telemetry(encode_telemetry(big))
    assert len(encode_telemetry(big)) > MAX_TELEMETRY_BYTES
    with pytest.raises(DecodeError, match=r"exceeds"):
        decode_durable(b" " * (2 * 1024 * 1024), schemas.Anomaly)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_junk_bytes_never_escape_as_other_errors(data: bytes) -> None:
    for decode in (decode_telemetry,
                   lambda d: decode_any_durable(d, schemas.Anomaly.ce_type())):
        try:
            decode(data)
        except DecodeError as exc:
            assert exc.reason


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["id", "job", "kind", "ranks", "onset_at",
                                        "detected_at", "evidence", "schema", "x"]),
                       json_values))
def test_junk_json_objects_are_rejected_or_valid(body: dict[str, object]) -> None:
    data = msgspec.json.encode(body)
    try:
        msg = decode_durable(data, schemas.Anomaly)
    except DecodeError as exc:
        assert exc.reason
    else:
        assert msg.schema == schemas.Anomaly.ce_type()


# -- subjects --------------------------------------------------------------------------


def test_subject_builders() -> None:
    s = Subjects()
    assert s.hb("llama-8b", 3) == "tg.llama-8b.hb.3"
    assert s.gpu("j", "node_a") == "tg.j.gpu.node_a"
    assert s.event("j", "incident") == "tg.j.event.incident"
    assert s.cmd_host("j", "node-b") == "tg.j.cmd.host.node-b"
    assert s.cmd_rank("j", 12) == "tg.j.cmd.rank.12"
    assert s.reg_node("j", "node-a") == "tg.j.reg.host-node-a"
    assert s.ack("j", "remediator") == "tg.j.ack.remediator"
    assert Subjects("prod.tg").dead("j") == "prod.tg.j.dead"


@pytest.mark.parametrize("bad", ["", "a.b", "a b", "*", ">", "ü", "x" * 129, None, 5])
def test_bad_job_tokens_are_refused_not_mangled(bad: object) -> None:
    with pytest.raises(InvalidToken, match="invalid job"):
        Subjects().hb(bad, 0)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, "x", 1.5, True])
def test_bad_ranks_are_refused(bad: object) -> None:
    with pytest.raises(InvalidToken, match="invalid rank"):
        Subjects().step("j", bad)  # type: ignore[arg-type]


def test_bad_event_kind_is_refused() -> None:
    with pytest.raises(InvalidToken, match="event kind"):
        Subjects().event("j", "gossip")


def test_parse_subjects() -> None:
    s = Subjects("prod.tg")
    p = s.parse("prod.tg.j1.hb.7")
    assert (p.job, p.kind, p.rank, p.host) == ("j1", "hb", 7, None)
    assert s.parse("prod.tg.j1.cmd.host.node-a").host == "node-a"
    assert s.parse("prod.tg.j1.reg.host-node-b").host == "node-b"
    assert s.parse("prod.tg.j1.reg.3").rank == 3
    assert s.job_of("other.j1.hb.1") is None
    with pytest.raises(InvalidToken):
        s.parse("prod.tg.j1")


def test_every_endpoint_answers_a_failure_in_its_own_reply() -> None:
    from trainguard.contract.rpc import CATALOGUE, ROLLBACK, SAVE, error_reply

    assert error_reply("resume", "j", "boom") == b""
    assert SAVE.decode_reply(error_reply("save", "j", "boom")).status == "error"
    assert ROLLBACK.decode_reply(error_reply("rollback", "j", "boom")).reason == "boom"
    assert CATALOGUE.decode_reply(error_reply("checkpoints", "j", "boom")).reason == "boom"
