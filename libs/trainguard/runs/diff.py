"""What differs between two run records, key by key.

Nested fields flatten to dotted keys (``git.revision``, ``packages.torch``,
``config.optim.lr``), so a diff names exactly the setting that changed; lists compare
whole. ``created_at`` is left out by default: it always differs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

import msgspec

from trainguard.contract.runrecord import RunRecord

IGNORED: Final = frozenset({"created_at"})


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; an empty mapping stays a value (``{}``)."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def diff_records(a: RunRecord, b: RunRecord, *,
                 ignore: Iterable[str] = IGNORED) -> list[tuple[str, Any, Any]]:
    """(key, value in ``a``, value in ``b``) for every key whose values differ, sorted by
    key; a key one side lacks has None there."""
    skip = set(ignore)
    fa = flatten(msgspec.to_builtins(a))
    fb = flatten(msgspec.to_builtins(b))
    return [(k, fa.get(k), fb.get(k)) for k in sorted(fa.keys() | fb.keys())
            if k not in skip and fa.get(k) != fb.get(k)]
