"""The images' install lines, replayed without a container engine.

The Dockerfile is parsed with BuildKit's own parser (as tests/unit/test_deploy.py does). The
``wheel`` stage is replayed as written (its COPY'd files into a temporary /src, its RUN
lines there). Each target (``services``, ``client``) then gets a fresh ``python -m venv``
and its stage's pip lines (those of the stages it is built FROM included), run by bash as
a RUN line is: ARGs are environment variables (their defaults, or what ``--build-arg``
would pass), the paths its COPY lines fill are the repository's files and the replayed
wheel directory. The one deviation: pip's cache is used (the images set PIP_NO_CACHE_DIR).

Then each venv is checked in a clean environment (no PYTHONPATH: the repository's libs
must not stand in for what the image lacks):

- every requirement of ``trainguard[<the extras on the Dockerfile's wheel line>]`` is
  installed, transitively, in a matching version (``pip check`` ignores extras; with
  ``--no-deps`` nothing else would notice a lock that lacks what an extra needs), and
  nothing is installed that those extras do not ask for (a lock and a wheel line that
  disagree: an extra dropped from the line, or a lock compiled with one too many);
- the services image runs ``trainguard service`` (every installed service loads, so its
  stack imports) and ``trainguard up``, and has no torch;
- the client image runs ``trainguard launch`` (the agent's launcher imports: redis and
  prometheus-client) and loads ``trainguard.torch``.

torch comes from a local wheel directory when pip has one (PIP_FIND_LINKS; TORCH_INDEX is
then PyPI, as a ``--build-arg`` would set it), else from the Dockerfile's default index.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dockerfile
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.locks import LOCKS, pins
from trainguard.cli.extras import EXTRA_OF

ROOT = Path(__file__).resolve().parents[2]
INSTALL_TIMEOUT = 900  # a cold pip cache downloads torch's dependencies
RUN_TIMEOUT = 120
# What `python -m venv` puts in a venv before any line of the image runs.
BOOTSTRAP = {"pip", "setuptools", "wheel"}
# The environment pip may use (index, find-links, proxies, CA bundle), nothing else.
PIP_ENV = ("HOME", "TMPDIR", "LANG", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE")


# -- the Dockerfile, as BuildKit reads it --------------------------------------------------

@dataclass
class Stage:
    name: str
    parent: str  # the FROM image, or the stage it builds on
    commands: list[Any] = field(default_factory=list)


def _stages() -> dict[str, Stage]:
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for cmd in dockerfile.parse_file(str(ROOT / "Dockerfile")):
        if cmd.cmd == "FROM":
            current = Stage(name=cmd.value[-1], parent=cmd.value[0])
            stages[current.name] = current
        elif current is not None:
            current.commands.append(cmd)
    return stages


def _chain(stages: dict[str, Stage], target: str) -> list[Stage]:
    """``target`` and the stages it is built FROM, the first built first."""
    chain = [stages[target]]
    while chain[0].parent in stages:
        chain.insert(0, stages[chain[0].parent])
    return chain


def _pip_lines(stage: Stage) -> list[str]:
    """The pip commands of the stage's RUN lines (user creation, compileall and clean-up
    are the image's business), less --no-cache-dir: the replay reuses pip's cache."""
    lines = []
    for cmd in stage.commands:
        if cmd.cmd != "RUN":
            continue
        for part in cmd.value[0].split("&&"):
            part = " ".join(part.split())
            if part.startswith("pip "):
                lines.append(part.replace(" --no-cache-dir", ""))
    return lines


def _substitute(line: str, paths: dict[str, Path]) -> str:
    """``line`` with each image path a COPY filled replaced by where it is here (one pass,
    longest first, whole path components only)."""
    if not paths:
        return line
    keys = "|".join(re.escape(p) for p in sorted(paths, key=len, reverse=True))
    return re.sub(rf"(?<![\w./-])({keys})(?=[/\s\"')]|$)", lambda m: str(paths[m[1]]), line)


def _copies(stage: Stage, built: dict[str, dict[str, Path]]) -> dict[str, Path]:
    """Image path -> local path for each COPY of ``stage``: the build context is the
    repository, ``--from=STAGE`` a stage replayed before (``built``)."""
    workdir = "/"
    paths: dict[str, Path] = {}
    for cmd in stage.commands:
        if cmd.cmd == "WORKDIR":
            workdir = cmd.value[0]
        if cmd.cmd != "COPY":
            continue
        *sources, dest = cmd.value
        if not dest.startswith("/"):
            dest = f"{workdir.rstrip('/')}/{dest.removeprefix('./')}"
        origin = next((f.split("=", 1)[1] for f in cmd.flags if f.startswith("--from=")), None)
        for src in sources:
            if origin is not None:
                if origin in built and src in built[origin]:
                    paths[dest.rstrip("/")] = built[origin][src]
                continue  # another image's files (kubectl): nothing to install from
            local = ROOT / src
            if local.is_dir() or not dest.endswith("/"):
                paths[dest.rstrip("/")] = local
            else:
                paths[dest + Path(src).name] = local
    return paths


def _args(chain: list[Stage], overrides: dict[str, str]) -> dict[str, str]:
    """The ARGs a RUN line of the last stage sees: their defaults, then ``--build-arg``."""
    args: dict[str, str] = {}
    for stage in chain:
        for cmd in stage.commands:
            if cmd.cmd == "ARG":
                name, _, default = cmd.value[0].partition("=")
                args[name] = overrides.get(name, default)
    return args


def _base_env(path: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k in PIP_ENV or (k.startswith("PIP_") and k != "PIP_NO_CACHE_DIR")
           or k.lower().endswith("_proxy")}
    env["PATH"] = path
    return env


def _sh(line: str, env: dict[str, str], cwd: Path) -> None:
    done = subprocess.run(["bash", "-c", f"set -euo pipefail; {line}"], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
    assert done.returncode == 0, f"{line}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"


# -- the replay -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def wheel_stage(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The ``wheel`` stage, replayed: its files into /src, its pip lines there. Its image
    paths -> the local ones (``/wheels`` for the targets' ``COPY --from=wheel``)."""
    stage = _stages()["wheel"]
    tmp = tmp_path_factory.mktemp("wheel")
    src, wheels = tmp / "src", tmp / "wheels"
    workdir = next(c.value[0] for c in stage.commands if c.cmd == "WORKDIR")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")  # as .dockerignore does
    for image_path, local in _copies(stage, {}).items():
        target = src / Path(image_path).relative_to(workdir)
        target.parent.mkdir(parents=True, exist_ok=True)
        if local.is_dir():
            shutil.copytree(local, target, ignore=ignore)
        else:
            shutil.copy2(local, target)
    paths = {workdir: src, "/wheels": wheels}
    env = _base_env(f"{Path(sys.executable).parent}{os.pathsep}/usr/bin{os.pathsep}/bin")
    for line in _pip_lines(stage):
        _sh(_substitute(line, paths), env, src)
    assert len(list(wheels.glob("trainguard-*.whl"))) == 1
    return {"/wheels": wheels}


def _torch_wheels_here() -> bool:
    dirs = os.environ.get("PIP_FIND_LINKS", "").split()
    return any(Path(d).is_dir() and any(Path(d).glob("torch-*.whl")) for d in dirs)


@dataclass
class Image:
    venv: Path
    extras: set[str]  # on the Dockerfile's trainguard wheel line
    args: dict[str, str]  # the ARGs its RUN lines saw

    def env(self) -> dict[str, str]:
        """A clean environment: the venv's bin, nothing of this test run's (no
        PYTHONPATH, no TRAINGUARD_*)."""
        return {"PATH": f"{self.venv / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin",
                "HOME": str(self.venv), "LANG": "C.UTF-8"}

    def run(self, *cmd: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(cmd, env=self.env(), cwd=self.venv, capture_output=True,
                              text=True, timeout=RUN_TIMEOUT)

    def ok(self, *cmd: str) -> str:
        done = self.run(*cmd)
        assert done.returncode == 0, f"{' '.join(cmd)}: {done.stdout}{done.stderr}"
        return done.stdout

    def python(self, code: str) -> subprocess.CompletedProcess[str]:
        return self.run(str(self.venv / "bin" / "python"), "-c", code)


def replay(target: str, wheel_stage: dict[str, Path], tmp: Path,
           build_args: dict[str, str]) -> Image:
    """A fresh venv with ``target``'s pip lines run in it, as ``docker build --target``."""
    chain = _chain(_stages(), target)
    venv = tmp / target
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=RUN_TIMEOUT,
                   env=_base_env(os.environ["PATH"]))
    args = _args(chain, build_args)
    env = {**_base_env(f"{venv / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin"), **args}
    lines: list[str] = []
    for stage in chain:
        paths = _copies(stage, {"wheel": wheel_stage})
        lines += [_substitute(line, paths) for line in _pip_lines(stage)]
    assert any(" -r " in line for line in lines), f"{target} installs no lock file: {lines}"
    extras: set[str] | None = None
    for line in lines:
        if (m := re.search(r"trainguard-\*\.whl\)?(?:\[([^\]]*)\])?", line)) is not None:
            assert "--no-deps" in line, f"{target}: the wheel resolves nothing again: {line}"
            extras = {e.strip() for e in (m[1] or "").split(",") if e.strip()}
        _sh(line, env, tmp)
    assert extras is not None, f"{target} installs no trainguard wheel: {lines}"
    return Image(venv=venv, extras=extras, args=args)


# -- what a venv holds ------------------------------------------------------------------------

DUMP = """
import importlib.metadata as md, json
print(json.dumps({d.metadata["Name"]: [d.version, d.requires or []]
                  for d in md.distributions()}))
"""


def _unmet_and_unasked(image: Image) -> tuple[list[str], list[str]]:
    """What ``trainguard[extras]`` needs, transitively, that is missing or in a version
    it does not accept; and what is installed that nothing of it asks for."""
    dists = {canonicalize_name(name): (version, requires) for name, (version, requires)
             in json.loads(image.ok(str(image.venv / "bin" / "python"), "-c", DUMP)).items()}
    unmet: list[str] = []
    reached = {"trainguard"}
    todo = [("trainguard", frozenset(image.extras))]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        for text in dists[name][1]:
            req = Requirement(text)
            dep = canonicalize_name(req.name)
            if req.marker is not None and not any(req.marker.evaluate({"extra": e})
                                                  for e in {"", *extras}):
                if "extra" not in str(req.marker) and dep in dists:
                    # Asked for on another Python or platform: the lock is for 3.11.x
                    # (redis' async-timeout before 3.11.3).
                    reached.add(dep)
                continue
            got = dists.get(dep)
            if got is None or not req.specifier.contains(got[0], prereleases=True):
                unmet.append(f"{name} needs {req} (installed: {got[0] if got else 'none'})")
                continue
            reached.add(dep)
            todo.append((dep, frozenset(req.extras)))
    unasked = sorted(set(dists) - reached - BOOTSTRAP)
    return unmet, unasked


def _check_locked(image: Image, target: str) -> None:
    unmet, unasked = _unmet_and_unasked(image)
    wanted = f"trainguard[{','.join(sorted(image.extras))}]"
    assert not unmet, f"the {target} image lacks what {wanted} needs: {unmet}"
    assert not unasked, (f"the {target} image installs {unasked}, which {wanted} does not "
                         "ask for: the lock and the Dockerfile's wheel line disagree")


IMPORT_ALL = """
import importlib, pkgutil, sys
absent = tuple(a for a in sys.argv[1].split(",") if a)
failed = []
for package in sys.argv[2:]:
    root = importlib.import_module(package)
    for m in [package, *(i.name for i in pkgutil.walk_packages(root.__path__, package + "."))]:
        if m.endswith("__main__"):
            continue
        try:
            importlib.import_module(m)
        except ModuleNotFoundError as exc:
            if not (exc.name or "").startswith(absent):
                failed.append(f"{m}: {exc!r}")
        except Exception as exc:
            failed.append(f"{m}: {exc!r}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def _imports_every_module(image: Image, *packages: str, without: tuple[str, ...] = ()) -> None:
    """The extras follow the layers: an install imports every module of its layers, but
    for those that need an extra it leaves out (``without``: a framework's example needs
    its framework)."""
    absent = ",".join(m for m, extra in EXTRA_OF.items() if extra and extra in without)
    done = image.run(str(image.venv / "bin" / "python"), "-c", IMPORT_ALL, absent, *packages)
    assert done.returncode == 0, f"{packages}: {done.stdout}{done.stderr[-2000:]}"


def _where(image: Image) -> Path:
    done = image.python("import trainguard; print(trainguard.__file__)")
    assert done.returncode == 0, done.stderr
    return Path(done.stdout.strip())


# -- the checks -------------------------------------------------------------------------------

@pytest.mark.timeout(INSTALL_TIMEOUT)  # before the suite's 180 s: the closest marker wins
def test_the_services_image_runs_the_control_plane_and_has_no_torch(
        wheel_stage: dict[str, Path], tmp_path: Path) -> None:
    image = replay("services", wheel_stage, tmp_path, {})
    assert _where(image).is_relative_to(image.venv)  # the image's trainguard, not libs/
    _check_locked(image, "services")
    image.ok("trainguard", "service", "detector", "--help")
    image.ok("trainguard", "up", "--help")
    # What `trainguard service NAME` loads past its --help: the extra's modules, and every
    # installed service (each imports redis, prometheus-client, the OTel SDK).
    loaded = image.python(
        "from trainguard.cli import extras; extras.require('services', 'trainguard service')\n"
        "from trainguard.runtime import registry\n"
        "names = sorted(registry.available())\n"
        "for name in names: registry.load(name)\n"
        "print(' '.join(names))")
    assert loaded.returncode == 0, loaded.stderr
    assert set(loaded.stdout.split()) >= {"detector", "diagnoser", "checkpointer",
                                          "remediator", "bridge"}
    no_torch = image.python("import torch")
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr
    _imports_every_module(image, "trainguard.contract", "trainguard.core", "trainguard.runtime",
                          "trainguard.analysis", "trainguard.services", "trainguard.cli",
                          "trainguard.dashboard")


@pytest.mark.timeout(INSTALL_TIMEOUT)
def test_the_client_image_launches_and_loads_the_torch_helpers(
        wheel_stage: dict[str, Path], tmp_path: Path) -> None:
    build_args = {"TORCH_INDEX": "https://pypi.org/simple"} if _torch_wheels_here() else {}
    image = replay("client", wheel_stage, tmp_path, build_args)
    assert _where(image).is_relative_to(image.venv)
    _check_locked(image, "client")
    image.ok("trainguard", "launch", "--help")
    # What `trainguard launch` runs past its --help (the agent's store and metrics), and
    # the torch helpers a trainer imports.
    loaded = image.python("import trainguard.agent.launcher, trainguard.torch, torch\n"
                          "print(torch.__version__)")
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip().split("+")[0] == image.args["TORCH_VERSION"]
    _imports_every_module(image, "trainguard.contract", "trainguard.core",
                          "trainguard.recovery", "trainguard.client", "trainguard.torch",
                          "trainguard.agent", "trainguard.examples",
                          without=("lightning", "hf"))


@pytest.mark.timeout(INSTALL_TIMEOUT)
def test_a_base_install_imports_every_module_a_rank_needs(
        wheel_stage: dict[str, Path], tmp_path: Path) -> None:
    """``pip install trainguard`` (no extra) is the client a training image needs: every
    module of the rank's torch-free layers imports with the base requirements alone (at the
    locked versions), and none of the control plane's stack is there."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {canonicalize_name(Requirement(r).name) for r in project["dependencies"]}
    locked = pins(LOCKS / "dev.lock")
    venv = tmp_path / "base"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=RUN_TIMEOUT,
                   env=_base_env(os.environ["PATH"]))
    env = _base_env(f"{venv / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin")
    wheel = next(wheel_stage["/wheels"].glob("trainguard-*.whl"))
    _sh(f"pip install -q {wheel} " + " ".join(f"{n}=={locked[n]}" for n in sorted(base)), env,
        tmp_path)
    image = Image(venv, set(), {})
    assert _where(image).is_relative_to(venv)
    _imports_every_module(image, "trainguard.contract", "trainguard.core", "trainguard.client")
    for module in ("redis", "prometheus_client", "torch"):
        assert image.python(f"import {module}").returncode != 0, module
