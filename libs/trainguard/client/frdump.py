"""The rank's flight-recorder dump on request: how a hung gloo (or NCCL) rank tells its agent
which collectives it issued and finished.

torch's c10d flight recorder (``TORCH_FR_BUFFER_SIZE``) records every collective on gloo
as on NCCL, but only NCCL's watchdog dumps it on its own (on a timeout). A hang on CPU never
times out soon, and a Python signal handler cannot run while the main thread is blocked in
a collective. So the agent asks through a file: it writes a request id to
``TRAINGUARD_FR_REQUEST``; the Guard's transport thread looks at that file every
:data:`POLL_S`, and on a new id writes ``torch._C._distributed_c10d._dump_fr_trace`` (the
entry point torch's own debug server and watchdog use; without C++ stack traces, which take
seconds to symbolize) to ``TORCH_FR_DUMP_TEMP_FILE<rank>``, atomically, then the id to
``<that>.id``. A rank frozen or dead writes nothing: its dump is missing, which is itself
the analysis' evidence (:mod:`trainguard.analysis.flightrec`).

torch is imported only when a request comes and ``torch.distributed`` is initialized:
``import trainguard`` stays free of it.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from trainguard.contract import envnames
from trainguard.core.files import write_atomically

log = logging.getLogger("trainguard.client")

POLL_S: Final = 0.1
"""A hang's remediation waits for the dumps before it kills the culprit; a look is one small
file read on the transport thread."""
DUMP_FILE: Final = "TORCH_FR_DUMP_TEMP_FILE"
"""torch's variable: the dump's path prefix, the rank appended (``trainguard launch`` sets it
in its log directory)."""


def read_request(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(200).strip()
    except OSError:
        return ""


class Trigger:
    """Watches the request file; :meth:`poll` runs on the Guard's transport thread."""

    def __init__(self, request: str, prefix: str, rank: int) -> None:
        self.request = request
        self.prefix = prefix
        self.dump = f"{prefix}{rank}"
        self.seen = read_request(request)
        """Requests older than this rank are not its business (a restarted group)."""

    def renumber(self, rank: int) -> None:
        """The rank's number changed in an in-place re-form: dumps go where the agent
        looks for that number's."""
        self.dump = f"{self.prefix}{rank}"

    @classmethod
    def from_env(cls, rank: int, env: Mapping[str, str] | None = None) -> Trigger | None:
        env = os.environ if env is None else env
        request, prefix = env.get(envnames.FR_REQUEST, ""), env.get(DUMP_FILE, "")
        if not request or not prefix:
            return None
        return cls(request, prefix, rank)

    def poll(self) -> None:
        token = read_request(self.request)
        if not token or token == self.seen:
            return
        self.seen = token
        try:
            raw = dump_bytes()
        except Exception as exc:  # the rank trains on; the agent sees no dump and says so
            log.warning("flight-recorder dump failed: %s: %s", type(exc).__name__, exc)
            return
        if raw is None:
            return
        write_atomically(Path(self.dump), raw)
        write_atomically(Path(self.dump + ".id"), token.encode())


def dump_bytes() -> bytes | None:
    """This process's flight-recorder dump (a pickle), None when torch.distributed is not
    in use here."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    import importlib

    c10d: Any = importlib.import_module("torch._C._distributed_c10d")  # no stubs for it
    return bytes(c10d._dump_fr_trace(includeStackTraces=False))
