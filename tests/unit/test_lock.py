"""Installs are reproducible: `make setup` installs requirements/dev.lock exactly, while the
library's own requirements stay ranges a user's resolver can satisfy."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.locks import LOCKS, pins

ROOT = Path(__file__).resolve().parents[2]


def _requirement_names(specs: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(s).name) for s in specs}


def test_this_environment_has_exactly_the_locked_versions() -> None:
    locked = pins(LOCKS / "dev.lock")
    assert len(locked) > 40, "the lock lists the whole environment, not only direct needs"
    installed = {canonicalize_name(d.metadata["Name"]): d.version
                 for d in importlib.metadata.distributions()}
    wrong = {name: (want, installed.get(name)) for name, want in locked.items()
             if installed.get(name) != want}
    assert wrong == {}, "run `make setup` (or `make lock` to move the lock on purpose)"


@pytest.mark.parametrize(("lock", "extras"), [
    ("dev.lock", ("dev", "torch", "gpu", "services", "embedded")),
    ("services.lock", ("services",)),
    ("client.lock", ("torch", "gpu", "agent")),
])
def test_every_lock_pins_what_its_extras_need(lock: str, extras: tuple[str, ...]) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = _requirement_names(project["dependencies"])
    for extra in extras:
        wanted |= _requirement_names(project["optional-dependencies"][extra])
    if lock == "client.lock":
        wanted.discard("torch")  # the image installs the torch build its index serves
    assert sorted(wanted - set(pins(LOCKS / lock))) == []


def test_the_library_keeps_open_ranges_for_its_users() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = [*project["dependencies"],
             *(s for extra in project["optional-dependencies"].values() for s in extra)]
    assert [s for s in specs if "==" in s] == []
