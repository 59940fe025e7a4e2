from __future__ import annotations

import uuid

from tests.samples import DURABLE
from trainguard.contract.envelope import make_headers, normalize_headers, uuid7


def test_uuid7_is_version_7_unique_and_time_ordered() -> None:
    ids = [uuid7() for _ in range(2000)]
    assert len(set(ids)) == len(ids)
    parsed = [uuid.UUID(i) for i in ids]
    assert all(u.version == 7 and u.variant == uuid.RFC_4122 for u in parsed)
    stamps = [u.int >> 80 for u in parsed]
    assert stamps == sorted(stamps)


def test_headers_are_cloudevents_and_fresh_per_publish() -> None:
    msg = DURABLE[0]
    a = make_headers(msg, source="trainguard/test", subject="tg.j1.reg.1")
    b = make_headers(msg, source="trainguard/test", subject="tg.j1.reg.1")
    assert a["ce-specversion"] == "1.0"
    assert a["ce-type"] == "io.trainguard.rank_hello.v1"
    assert a["Nats-Msg-Id"] == a["ce-id"] != b["ce-id"]
    assert a["ce-time"].endswith("Z")


def test_header_names_are_normalised() -> None:
    h = normalize_headers({"CE-TYPE": "x", "nats-msg-id": "1", "X-Custom": "y"})
    assert h == {"ce-type": "x", "Nats-Msg-Id": "1", "X-Custom": "y"}
