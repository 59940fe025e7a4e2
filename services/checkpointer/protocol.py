"""Request and reply bodies of the coordinator's core request/reply endpoints.

``<prefix>.<job>.rpc.resume`` replies with a bare ``ResumePoint`` (JSON, as in LATEST) or an
empty payload when there is none, because that is what ``Guard.resume_point()`` reads. The
other endpoints take and return the JSON objects below; an empty request means defaults.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

import msgspec

from trainguard.schemas import ResumePoint

SaveStatus = Literal["committed", "suspect", "failed", "timeout", "bad_request", "error"]


class SaveRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    deadline: float | None = None
    """Seconds to wait for the commit; default: the ``save_deadline`` setting."""
    reason: str = ""
    blocking: bool = False
    """Ask ranks for a blocking save (for a process about to be stopped)."""


class SaveReply(msgspec.Struct, kw_only=True):
    ok: bool
    job: str
    status: SaveStatus
    step: int | None = None
    path: str = ""
    checkpoint_id: str = ""
    reason: str = ""
    missing_ranks: list[int] = []
    """Ranks that did not report the checkpoint."""
    failed_ranks: list[int] = []
    """Ranks that reported a failed save or files that do not verify."""
    command_ids: list[str] = []
    elapsed: float = 0.0


class RollbackRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    below_step: int
    reason: str = ""


class RollbackReply(msgspec.Struct, kw_only=True):
    ok: bool
    job: str
    point: ResumePoint | None = None
    step: int | None = None
    suspect_steps: list[int] = []
    """Checkpoints at or above ``below_step`` that the rollback marked suspect."""
    reason: str = ""


class CatalogueRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    limit: int = 100


class CatalogueReply(msgspec.Struct, kw_only=True):
    job: str
    pointer: ResumePoint | None = None
    pin: int | None = None
    interval: dict[str, Any] | None = None
    onsets: dict[str, Any] = {}
    checkpoints: list[dict[str, Any]] = []


R = TypeVar("R", bound=msgspec.Struct)


def decode_request(data: bytes, cls: type[R]) -> R:
    """Decode a request; an empty payload is an all-defaults request.

    Raises ``msgspec.ValidationError``/``DecodeError`` for a malformed one.
    """
    return msgspec.json.decode(data or b"{}", type=cls)


def encode(reply: msgspec.Struct) -> bytes:
    return msgspec.json.encode(reply)
