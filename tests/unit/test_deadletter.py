"""Dead letters always fit, and sizes are refused with the size: the rules without a bus."""

from __future__ import annotations

import hashlib

import pytest

from trainguard.contract import schemas
from trainguard.contract.codec import (
    MAX_DURABLE_BYTES,
    check_wire_size,
    decode_any_durable,
    decode_durable,
    encode_durable,
    header_size,
)
from trainguard.contract.errors import DecodeError, MessageTooLarge
from trainguard.runtime.deadletter import (
    KEEP_WHOLE,
    MAX_REASON,
    bounded_headers,
    bounded_letter,
    clip,
)

MIB = 1024 * 1024


@pytest.mark.parametrize(("size", "limit", "whole"), [
    (0, MIB, True),
    (100, MIB, True),
    (KEEP_WHOLE, MIB, True),            # up to the keep limit: whole
    (KEEP_WHOLE + 1, MIB, False),
    (MIB - 2048, MIB, False),           # the probe's poison: just under the streams' 1 MiB
    (MIB - 2048, MIB - 600, False),     # the budget left after the letter's own headers
    (5000, 4096, False),                # a server with a small max_payload
    (1000, 4096, True),
])
def test_a_letter_fits_its_budget_and_identifies_the_whole_payload(
        size: int, limit: int, whole: bool) -> None:
    payload = bytes(i % 251 for i in range(size))
    letter = bounded_letter(job="j", subject="tg.j.event.anomaly", reason="invalid anomaly",
                            service="diagnoser", consumer="diagnoser", payload=payload,
                            limit=limit, headers={"ce-type": "io.trainguard.anomaly.v1"},
                            deliveries=1, now=5.0)
    body = encode_durable(letter)
    assert len(body) <= limit
    back = decode_durable(body, schemas.DeadLetter)
    assert back.size == size and back.sha256 == hashlib.sha256(payload).hexdigest()
    assert back.truncated is not whole
    assert payload.startswith(back.payload)
    assert (back.payload == payload) is whole
    if not whole:  # the head is as long as the budget allows (base64: 4 chars per 3 bytes)
        assert len(back.payload) == KEEP_WHOLE or len(body) > limit - 8
    assert back.consumer == "diagnoser" and back.headers["ce-type"].endswith("anomaly.v1")


def test_huge_reasons_and_headers_are_clipped_not_fatal() -> None:
    letter = bounded_letter(job="j", subject="tg.j.exit.h", reason="x" * MIB, service="s",
                            payload=b"{}", limit=MIB,
                            headers={"ce-type": "t", "junk": "y" * MIB,
                                     **{f"h{i}": "z" * 400 for i in range(40)}})
    assert len(letter.reason) == MAX_REASON and letter.reason.endswith("…")
    assert letter.headers["ce-type"] == "t" and "junk" in letter.headers
    assert len(letter.headers["junk"]) <= 512
    assert sum(len(k) + len(v) for k, v in letter.headers.items()) <= 4096
    assert len(encode_durable(letter)) <= MIB


def test_a_budget_too_small_for_any_letter_is_a_clear_error() -> None:
    with pytest.raises(MessageTooLarge, match=r"dead letter for tg.j.dead.*-byte limit"):
        bounded_letter(job="j", subject="tg.j.dead", reason="r", service="s",
                       payload=b"p" * 1000, limit=100)
    tight = bounded_letter(job="j", subject="tg.j.dead", reason="r" * 3000, service="s",
                           payload=b"p", limit=600, headers={"a": "b" * 500})
    assert tight.headers == {} and len(encode_durable(tight)) <= 600  # kept what identifies it


def test_old_letters_decode_with_the_new_fields_unknown() -> None:
    old = b'{"schema":"io.trainguard.dead_letter.v1","job":"j","subject":"s","reason":"r",' \
          b'"payload":"AAE="}'
    letter = decode_any_durable(old, schemas.DeadLetter.ce_type())
    assert isinstance(letter, schemas.DeadLetter)
    assert (letter.payload, letter.size, letter.sha256, letter.truncated) == \
        (b"\x00\x01", 0, "", False)


@pytest.mark.parametrize(("body", "headers", "max_payload", "refused"), [
    (1000, {}, MIB, None),
    (MAX_DURABLE_BYTES + 1, {}, 8 * MIB, r"oversized anomaly on s: 1048577 bytes exceeds the "
                                         r"1048576-byte limit"),
    (MIB - 10, {"ce-type": "io.trainguard.anomaly.v1"}, MIB,
     r"oversized anomaly on s \(body and headers\): \d+ bytes exceeds the 1048576-byte"),
    (MIB - 100, {"ce-type": "io.trainguard.anomaly.v1"}, MIB, None),
])
def test_publishes_the_server_would_not_take_are_refused_with_their_size(
        body: int, headers: dict[str, str], max_payload: int, refused: str | None) -> None:
    if refused is None:
        check_wire_size("anomaly on s", b"x" * body, headers, max_payload)
    else:
        with pytest.raises(MessageTooLarge, match=refused):
            check_wire_size("anomaly on s", b"x" * body, headers, max_payload)


def test_header_size_is_what_nats_writes() -> None:
    assert header_size({}) == 0
    # NATS/1.0\r\n + "a: bc\r\n" + \r\n
    assert header_size({"a": "bc"}) == len(b"NATS/1.0\r\na: bc\r\n\r\n")


def test_decoding_an_oversized_message_names_its_size() -> None:
    with pytest.raises(MessageTooLarge, match=r"oversized anomaly: 2097152 bytes exceeds") as exc:
        decode_durable(b" " * (2 * MIB), schemas.Anomaly)
    assert isinstance(exc.value, DecodeError) and exc.value.size == 2 * MIB


@pytest.mark.parametrize(("text", "limit", "out"), [
    ("abc", 3, "abc"), ("abcd", 3, "ab…"), ("", 0, ""),
])
def test_clip(text: str, limit: int, out: str) -> None:
    assert clip(text, limit) == out


def test_bounded_headers_keep_cloudevents_first() -> None:
    kept = bounded_headers({"x-big": "v" * 300, "ce-id": "1", "traceparent": "t"}, budget=20)
    assert kept == {"ce-id": "1", "traceparent": "t"}
