"""What a run record reads about the process's surroundings: code, packages, hardware, env.

Each probe is bounded and never raises: a run record is written beside every checkpoint,
and a host without git, /proc or a GPU must still save. torch is read only when the
trainer imported it already (``sys.modules``), never imported here.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import re
import subprocess
import sys
from collections.abc import Mapping
from importlib import metadata
from typing import Any, Final

from trainguard.contract import envnames
from trainguard.contract.runrecord import GitState, Hardware

GIT_TIMEOUT: Final = 5.0
"""Seconds each git call may take (a huge work tree on a slow file system)."""
ENV_PREFIXES: Final = ("TRAINGUARD_", "TORCHELASTIC_", "TORCH_", "PYTORCH_", "NCCL_", "CUDA_",
                       "CUDNN_", "CUBLAS_", "NVIDIA_", "GLOO_", "OMP_", "MKL_", "KMP_", "HF_")
ENV_NAMES: Final = frozenset({
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
    "PYTHONHASHSEED", "TOKENIZERS_PARALLELISM", "LD_LIBRARY_PATH", "LD_PRELOAD",
})
"""torchrun's variables and the ones that change numerics or threading."""
SECRET_MARKERS: Final = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "CREDENTIAL", "CREDS",
                         "AUTH")
REDACTED: Final = "<redacted>"
_URL_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@")


def relevant_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of :data:`ENV_PREFIXES` and :data:`ENV_NAMES`, with the values of
    anything that names a secret (or is one of trainguard's access settings) redacted and
    passwords in URLs (``redis://user:pw@host``) cut out."""
    env = os.environ if env is None else env
    out = {}
    for name, value in env.items():
        if not (name.startswith(ENV_PREFIXES) or name in ENV_NAMES):
            continue
        upper = name.upper()
        if name in envnames.ACCESS or any(m in upper for m in SECRET_MARKERS):
            out[name] = REDACTED
        else:
            out[name] = _URL_USERINFO.sub(rf"\g<scheme>{REDACTED}@", value)
    return dict(sorted(out.items()))


def packages() -> dict[str, str]:
    """Installed distributions, normalised name -> version."""
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(re.sub(r"[-_.]+", "-", name).lower(), dist.version)
    return dict(sorted(found.items()))


def _git(args: list[str], cwd: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, timeout=GIT_TIMEOUT,
                          check=False)


def git_state(path: str | os.PathLike[str] | None = None) -> GitState:
    """The revision of the work tree holding ``path`` (default: the current directory),
    whether tracked files differ from it, and the SHA-256 of that difference."""
    cwd = os.fspath(path) if path is not None else os.getcwd()
    try:
        top = _git(["rev-parse", "--show-toplevel"], cwd)
        if top.returncode != 0:
            return GitState(error=top.stderr.decode(errors="replace").strip()[:200]
                            or "not a git work tree")
        root = top.stdout.decode().strip()
        head = _git(["rev-parse", "HEAD"], root)
        branch = _git(["rev-parse", "--abbrev-ref", "HEAD"], root)
        diff = _git(["diff", "HEAD", "--binary", "--no-color", "--no-ext-diff"], root)
    except FileNotFoundError:
        return GitState(error="git is not installed")
    except subprocess.TimeoutExpired:
        return GitState(error=f"git did not answer within {GIT_TIMEOUT:g}s")
    except OSError as exc:
        return GitState(error=str(exc))
    if head.returncode != 0:  # a repository without a commit yet
        return GitState(root=root, error="no commit yet")
    dirty = diff.returncode == 0 and bool(diff.stdout)
    return GitState(revision=head.stdout.decode().strip(),
                    branch=branch.stdout.decode().strip() if branch.returncode == 0 else "",
                    dirty=dirty, diff_sha256=hashlib.sha256(diff.stdout).hexdigest()
                    if dirty else "", root=root,
                    error="" if diff.returncode == 0 else "git diff failed")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def hardware() -> Hardware:
    """CPU, memory and, where the trainer's torch sees CUDA (or NVML answers), the GPUs."""
    hw = Hardware(cpu_model=_cpu_model(), cpu_count=os.cpu_count() or 0,
                  memory_bytes=_memory_bytes())
    torch: Any = sys.modules.get("torch")
    if torch is not None:
        hw.torch = str(getattr(torch, "__version__", ""))
        try:
            hw.cuda = str(torch.version.cuda or "")
            if torch.cuda.is_available():
                hw.gpu_count = torch.cuda.device_count()
                hw.gpus = [torch.cuda.get_device_name(i) for i in range(hw.gpu_count)]
                hw.nccl = ".".join(str(v) for v in _as_tuple(torch.cuda.nccl.version()))
                hw.cudnn = str(torch.backends.cudnn.version() or "")
        except Exception:  # a broken CUDA install: the record says what it could read
            pass
    _nvml(hw)
    return hw


def _as_tuple(version: Any) -> tuple[Any, ...]:
    return tuple(version) if isinstance(version, tuple | list) else (version,)


def _nvml(hw: Hardware) -> None:
    """The driver version (and the GPUs, when torch did not list them) from NVML, if
    ``pynvml`` is installed and a driver answers."""
    try:
        import pynvml
    except ImportError:
        return
    try:
        pynvml.nvmlInit()
    except Exception:
        return
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        hw.driver = driver.decode() if isinstance(driver, bytes) else str(driver)
        if not hw.gpus:
            count = int(pynvml.nvmlDeviceGetCount())
            names = [pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
                     for i in range(count)]
            hw.gpus = [n.decode() if isinstance(n, bytes) else str(n) for n in names]
            hw.gpu_count = count
    except Exception:
        pass
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
