"""The ranks' output: each rank writes its stdout and stderr to files in the launch log
dir (a warm spare redirects to the same files when it becomes the rank), and this tailer
copies their complete lines to the launcher's own stdout/stderr as ``[<rank>]:<line>``,
like torchrun's ``--tee``. Files, not pipes, so a rank never blocks on (or dies of) an
agent that stopped reading, and a worker's exit can quote its last stderr lines.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import TextIO


@dataclass
class _Watched:
    path: str
    prefix: str
    stream: TextIO
    offset: int = 0
    partial: bytes = field(default=b"")


class OutputTail:
    def __init__(self, interval: float = 0.1) -> None:
        self.interval = interval
        self._files: list[_Watched] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainguard-agent-tail",
                                        daemon=True)
        self._thread.start()

    def watch(self, path: str, rank: int, *, err: bool) -> None:
        with self._lock:
            self._files.append(_Watched(path, f"[{rank}]:", sys.stderr if err else sys.stdout))

    def forget(self, paths: set[str]) -> None:
        """Copy what is left of ``paths`` and stop watching them (their rank ended)."""
        with self._lock:
            done = [w for w in self._files if w.path in paths]
            self._files = [w for w in self._files if w.path not in paths]
        for w in done:
            self._copy(w, final=True)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self.forget({w.path for w in self._files})

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                files = list(self._files)
            for w in files:
                self._copy(w)

    @staticmethod
    def _copy(w: _Watched, final: bool = False) -> None:
        try:
            with open(w.path, "rb") as fh:
                fh.seek(w.offset)
                data = fh.read(1 << 20)
        except OSError:
            return
        if not data and not (final and w.partial):
            return
        w.offset += len(data)
        lines = (w.partial + data).split(b"\n")
        w.partial = b"" if final else lines.pop()
        text = "".join(f"{w.prefix}{line.decode('utf-8', 'replace')}\n"
                       for line in lines if line or not final)
        with contextlib.suppress(OSError, ValueError):
            w.stream.write(text)
            w.stream.flush()


def rank_files(log_dir: str, attempt: int, local_rank: int, generation: int) -> tuple[str, str]:
    """The stdout and stderr files of one rank process (new files per process)."""
    folder = os.path.join(log_dir, f"attempt_{attempt}", f"gen_{generation}", str(local_rank))
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, "stdout.log"), os.path.join(folder, "stderr.log")
