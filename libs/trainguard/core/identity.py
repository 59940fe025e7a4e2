"""Who this rank is: job, rank, world size, host, attempt, and an environment record.

Defaults come from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``TORCHELASTIC_RESTART_COUNT``) and from ``trainguard launch`` (``TRAINGUARD_JOB``,
``TRAINGUARD_HOST``; the names are :mod:`trainguard.contract.envnames`), so ``Guard()`` needs no
arguments under the launcher. Invalid values are a ``ValueError`` at construction, never a
mangled subject later.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

from trainguard.contract import envnames
from trainguard.contract.schemas import Attempt
from trainguard.contract.subjects import check_rank, check_token


@dataclass(frozen=True, slots=True)
class Identity:
    job: str
    rank: int
    world_size: int
    local_rank: int
    host: str
    attempt: Attempt

    @property
    def responder(self) -> str:
        """How this rank signs its command acks."""
        return f"rank-{self.rank}"


def _int_env(env: Mapping[str, str], key: str, default: int) -> int:
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {key}={raw!r} is not an integer") from None


def host_token(name: str) -> str:
    """A hostname as one subject token: the short name, with characters NATS forbids
    replaced. Used only for the machine's own hostname, never for a name a user gave."""
    short = name.split(".")[0] or "localhost"
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in short)[:128]


def resolve_identity(
    job: str | None,
    rank: int | None,
    world_size: int | None,
    host: str | None,
    env: Mapping[str, str] | None = None,
) -> Identity:
    env = os.environ if env is None else env
    job = job if job is not None else env.get(envnames.JOB)
    if job is None:
        raise ValueError(f"Guard needs a job name: Guard(job='my-job') or {envnames.JOB}")
    check_token("job", job)
    rank = check_rank(rank if rank is not None else _int_env(env, envnames.RANK, 0))
    world_size = world_size if world_size is not None else _int_env(env, envnames.WORLD_SIZE, 1)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"invalid world size {world_size!r}: must be a positive integer")
    if rank >= world_size:
        raise ValueError(f"invalid rank {rank}: must be below the world size {world_size}")
    local_rank = _int_env(env, envnames.LOCAL_RANK, 0)
    if host is not None:
        check_token("host", host)
    else:
        host = env.get(envnames.HOST) or host_token(socket.gethostname())
        check_token("host", host)
    attempt = Attempt(restart_count=_int_env(env, envnames.RESTART_COUNT, 0),
                      pid=os.getpid(), started_at=time.time(),
                      generation=_int_env(env, envnames.GENERATION, 0))
    return Identity(job, rank, world_size, local_rank, host, attempt)


def environment_record(seed: int | None = None) -> dict[str, str]:
    """What a reproduction or a diagnosis needs to know about this process.

    Reads torch versions only if the trainer already imported torch: the client must not
    pull torch in by itself.
    """
    record = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "argv": " ".join(sys.argv),
        "cwd": os.getcwd(),
    }
    if seed is not None:
        record["seed"] = str(seed)
    torch = sys.modules.get("torch")
    if torch is not None:
        record["torch"] = str(getattr(torch, "__version__", "?"))
        version = getattr(torch, "version", None)
        record["cuda"] = str(getattr(version, "cuda", None))
        try:
            if torch.cuda.is_available():
                record["device"] = torch.cuda.get_device_name(0)
        except Exception:
            pass
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=1.0, check=False)
        if commit.returncode == 0:
            record["git_commit"] = commit.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return record
