"""Encoding and decoding of every message, with the errors a dead letter needs.

Telemetry is tagged MessagePack (cheap: ~1 µs per step report). Durable messages are
JSON in which non-finite floats travel as the strings ``"nan"``, ``"inf"``, ``"-inf"``:
msgspec's JSON encoder would write ``null``, which then fails to decode as a float, and
a NaN loss is exactly what an incident needs to carry.

Sizes are checked before anything is read or sent: a body over its limit is refused whole
with :class:`MessageTooLarge` (size and limit in the reason), and :func:`check_wire_size`
holds a publish to what the server takes (body plus headers within its ``max_payload``:
nats-py checks the body alone, and a server that gets more drops the connection).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final, TypeVar

import msgspec

from .errors import DecodeError, MessageTooLarge
from .schemas import BY_CE_TYPE, Durable, TelemetryMessage

MAX_TELEMETRY_BYTES: Final = 64 * 1024
MAX_DURABLE_BYTES: Final = 1024 * 1024
"""The largest durable body, the streams' ``max_msg_size``."""
_HEADER_LINE: Final = len(b"NATS/1.0\r\n")

D = TypeVar("D", bound=Durable)

_mp_encoder = msgspec.msgpack.Encoder()
_mp_decoder: msgspec.msgpack.Decoder[TelemetryMessage] = msgspec.msgpack.Decoder(TelemetryMessage)
_json_encoder = msgspec.json.Encoder()
_json_decoders: dict[type[Any], msgspec.json.Decoder[Any]] = {}


def encode_telemetry(msg: TelemetryMessage) -> bytes:
    return _mp_encoder.encode(msg)


def decode_telemetry(data: bytes, *, max_bytes: int = MAX_TELEMETRY_BYTES) -> TelemetryMessage:
    """Decode one telemetry payload; :class:`DecodeError` names the field at fault."""
    if len(data) > max_bytes:
        raise MessageTooLarge("telemetry", len(data), max_bytes)
    try:
        return _mp_decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise DecodeError(f"invalid telemetry: {exc}") from None
    except msgspec.DecodeError as exc:
        raise DecodeError(f"malformed telemetry (not MessagePack): {exc}") from None


def _finite_safe(value: Any) -> Any:
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, dict):
        return {k: _finite_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_safe(v) for v in value]
    return value


def encode_durable(msg: Durable) -> bytes:
    """JSON with non-finite floats as strings (low-rate path: the extra walk is fine)."""
    return _json_encoder.encode(_finite_safe(msgspec.to_builtins(msg)))


def header_size(headers: Mapping[str, str]) -> int:
    """Bytes the headers take on the wire (``NATS/1.0`` block, as nats-py writes it)."""
    if not headers:
        return 0
    return _HEADER_LINE + sum(len(k.encode()) + len(v.encode()) + 4
                              for k, v in headers.items()) + 2


def check_wire_size(what: str, body: bytes, headers: Mapping[str, str], max_payload: int,
                    *, max_body: int = MAX_DURABLE_BYTES) -> None:
    """Refuse a publish the server (``max_payload``) or a stream (``max_body``) would not
    take, with :class:`MessageTooLarge` naming ``what`` and the size."""
    if len(body) > max_body:
        raise MessageTooLarge(what, len(body), max_body)
    total = len(body) + header_size(headers)
    if total > max_payload:
        raise MessageTooLarge(f"{what} (body and headers)", total, max_payload)


def decode_durable(data: bytes, cls: type[D], *, max_bytes: int = MAX_DURABLE_BYTES) -> D:
    """Decode ``data`` as ``cls``, checking the body's ``schema`` mirrors ``cls``'s version.

    Lax mode lets ``"nan"``/``"inf"`` strings decode into float fields.
    """
    if len(data) > max_bytes:
        raise MessageTooLarge(cls.KIND, len(data), max_bytes)
    decoder = _json_decoders.get(cls)
    if decoder is None:
        decoder = _json_decoders[cls] = msgspec.json.Decoder(cls, strict=False)
    try:
        msg: D = decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise DecodeError(f"invalid {cls.KIND}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise DecodeError(f"malformed {cls.KIND} (not JSON): {exc}") from None
    if msg.schema != cls.ce_type():
        raise DecodeError(
            f"unsupported schema {msg.schema!r} for {cls.KIND} (expected {cls.ce_type()!r})"
        )
    return msg


def durable_type(ce_type: str | None) -> type[Durable]:
    """The Struct for a ``ce-type`` header; unknown kinds and versions are errors."""
    if not ce_type:
        raise DecodeError("missing ce-type header")
    cls = BY_CE_TYPE.get(ce_type)
    if cls is None:
        raise DecodeError(f"unknown message type or version {ce_type!r}")
    return cls


def decode_as(data: bytes, ce_type: str | None, cls: type[D]) -> D:
    """Decode a message that must be a ``cls``: its ``ce-type`` header says so, or it is
    refused before its body is read (a receiver acts only on what is typed as its own)."""
    if ce_type != cls.ce_type():
        raise DecodeError(f"ce-type {ce_type!r} is not {cls.ce_type()!r}"
                          if ce_type else f"missing ce-type header (expected {cls.ce_type()!r})")
    return decode_durable(data, cls)


def decode_any_durable(data: bytes, ce_type: str | None) -> Durable:
    """Decode a durable message whose type is named only by its ``ce-type`` header."""
    return decode_durable(data, durable_type(ce_type))
