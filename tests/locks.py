"""The pins of ``requirements/*.lock``, read the one way the lock and image tests share."""

from __future__ import annotations

from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

LOCKS = Path(__file__).resolve().parents[1] / "requirements"


def pins(lock: Path) -> dict[str, str]:
    """Canonical name -> pinned version of every ``name==version`` line of ``lock``."""
    found: dict[str, str] = {}
    for line in lock.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            req = Requirement(line)
            (spec,) = req.specifier  # a lock pins each package exactly
            assert spec.operator == "==", line
            found[canonicalize_name(req.name)] = spec.version
    return found
