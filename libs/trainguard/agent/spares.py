"""The agent's pool of warm spares (see :mod:`.spare` for the spare's side).

A spare is started with the node's base worker environment (so what torch reads at import
matches the ranks') and counts as ready once it wrote ``ready``; :meth:`SparePool.take`
hands out a ready one, whose process then *is* the rank (same pid). Spares are started
from the supervising thread only: the kernel's parent-death signal follows the thread that
forked, so the spare dies with the agent and not with some helper thread. The pool is
bounded (``size`` idle spares at most) and gives up refilling after ``max_failures``
spares in a row died before they were ready, so a broken environment never forks forever.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from . import procs
from .spare import READY, SpareOrder, encode_order

log = logging.getLogger("trainguard.agent")

SPARE_MODULE = "trainguard.agent.spare"


class Spare:
    def __init__(self, env: Mapping[str, str], log_path: str,
                 target: Sequence[str] = ()) -> None:
        with open(log_path, "ab") as err:
            self.popen: subprocess.Popen[bytes] = subprocess.Popen(
                [sys.executable, "-u", "-m", SPARE_MODULE, str(os.getpid()), *target],
                env=dict(env), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                start_new_session=True)
        self.log_path = log_path
        self.started = time.monotonic()
        self.ready = threading.Event()
        threading.Thread(target=self._await_ready, name=f"spare-{self.pid}",
                         daemon=True).start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _await_ready(self) -> None:
        assert self.popen.stdout is not None
        with contextlib.suppress(OSError, ValueError):
            for line in self.popen.stdout:  # an import may print before the spare is ready
                if line == READY:
                    self.ready.set()
                    return

    def alive(self) -> bool:
        return self.popen.poll() is None

    def activate(self, order: SpareOrder) -> subprocess.Popen[bytes]:
        """Turn this spare into the rank ``order`` describes; returns its process."""
        assert self.popen.stdin is not None
        self.popen.stdin.write(encode_order(order))
        self.popen.stdin.close()
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        return self.popen

    def discard(self) -> None:
        """An idle spare goes: end-of-file first (it exits by itself), then a kill."""
        for pipe in (self.popen.stdin, self.popen.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        procs.send(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)


class SparePool:
    def __init__(self, size: int, env: Mapping[str, str], log_dir: str, *,
                 ready_timeout: float = 120.0, max_failures: int = 3,
                 target: Sequence[str] = ()) -> None:
        self.size = max(0, size)
        self.target = list(target)
        """``["-m", module]`` or ``[script]``: the rank's program, whose top-level imports
        from installed libraries each spare makes before it is ready."""
        self.env = dict(env)
        self.log_dir = log_dir
        self.ready_timeout = ready_timeout
        self.max_failures = max_failures
        self._spares: list[Spare] = []
        self._failures = 0
        self._lock = threading.Lock()
        self.started_total = 0

    def fill(self) -> None:
        """Drop dead or stuck spares and, while fewer than ``size`` are kept, start one once
        the others are ready (supervising thread; called again until the pool is full)."""
        with self._lock:
            for s in list(self._spares):
                stuck = not s.ready.is_set() and \
                    time.monotonic() - s.started > self.ready_timeout
                if not s.alive() or stuck:
                    self._spares.remove(s)
                    if not s.ready.is_set():
                        self._failures += 1
                        log.warning("warm spare %d died or hung before it was ready (see %s)",
                                    s.pid, s.log_path)
                    s.discard()
                elif s.ready.is_set():
                    self._failures = 0
            if self._failures >= self.max_failures:
                return
            # One spare warms up at a time: a refill's torch imports compete with the ranks
            # that just started (and with each other) for the node's cores.
            if len(self._spares) < self.size and all(s.ready.is_set() for s in self._spares):
                self.started_total += 1
                path = os.path.join(self.log_dir, f"spare-{self.started_total}.log")
                self._spares.append(Spare(self.env, path, self.target))

    def take(self) -> Spare | None:
        """A ready spare, out of the pool (None when none is ready)."""
        with self._lock:
            for s in self._spares:
                if s.ready.is_set() and s.alive():
                    self._spares.remove(s)
                    return s
        return None

    def ready_pids(self) -> list[int]:
        """The pids of the idle spares that are ready to become a rank."""
        with self._lock:
            return [s.pid for s in self._spares if s.ready.is_set() and s.alive()]

    def close(self) -> None:
        with self._lock:
            spares, self._spares = self._spares, []
        for s in spares:
            s.discard()
