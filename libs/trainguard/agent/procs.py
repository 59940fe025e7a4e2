"""Local worker processes: their Linux state letters and the signals the agent sends.

A stopped (T) or uninterruptible (D) worker ignores SIGTERM until it runs again, which
would hold a restart for the launcher's whole grace period; such workers get SIGCONT and
SIGKILL at once.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from collections.abc import Iterable, Mapping
from typing import cast

from trainguard.contract.schemas import PROCESS_STATES, ProcessState, is_gone, is_stopped


def state_of(pid: int) -> ProcessState:
    """The state letter of ``pid`` (R, S, D, T, t, Z, ...), or ``X`` if it is gone.

    A letter no kernel defines (a garbled read) counts as ``S``, an ordinary live
    process: the detector's heartbeat rules still judge it, and nothing is killed for it.
    """
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            data = fh.read()
    except OSError:
        return "X"
    # The command name (field 2) may contain spaces; the state follows its closing ')'.
    letter = data[data.rfind(")") + 2: data.rfind(")") + 3]
    if not letter:
        return "X"
    return cast(ProcessState, letter) if letter in PROCESS_STATES else "S"


def notable_change(before: Mapping[int, ProcessState],
                   after: Mapping[int, ProcessState]) -> bool:
    """Whether a rank entered or left a state the detector acts on at once (SIGSTOP's T,
    or gone): worth a node heartbeat now. The brief ones (t, D, a profiler or a disk
    write) wait for the regular beat, or they would flood the bus; so do ranks that came
    or were renumbered, which the detector matches against the ranks' own hellos."""
    return any((before[r] == "T") != (after[r] == "T") or is_gone(before[r]) != is_gone(after[r])
               for r in after.keys() & before.keys())


def alive(pid: int) -> bool:
    return not is_gone(state_of(pid))


def send(pid: int, sig: signal.Signals) -> bool:
    """Signal our own worker; False if it is already gone."""
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def catches(pid: int, sig: signal.Signals) -> bool:
    """Whether ``pid`` has a handler for ``sig`` now (its ``SigCgt`` mask): a signal whose
    default action ends the process (SIGUSR1) must not reach a rank before it installed
    its handler. False when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (int(sig) - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def signal_group(pid: int, sig: signal.Signals) -> bool:
    """Signal a worker and the processes it started (it leads its own session, so its pid
    is its process group's id); False if it is already gone."""
    try:
        os.killpg(pid, sig)
        return True
    except ProcessLookupError:
        return send(pid, sig)
    except PermissionError:
        return send(pid, sig)


def kill_stuck(pids: Iterable[int]) -> list[int]:
    """SIGCONT + SIGKILL every stuck worker; returns the pids it killed."""
    killed = []
    for pid in pids:
        if is_stopped(state_of(pid)):
            send(pid, signal.SIGCONT)
            send(pid, signal.SIGKILL)
            killed.append(pid)
    return killed


def terminate(pids: Iterable[int], grace: float) -> None:
    """SIGTERM (SIGKILL for stuck ones), then SIGKILL whatever is left after ``grace``."""
    pids = list(pids)
    kill_stuck(pids)
    for pid in pids:
        send(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    for pid in pids:
        if alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


STACK_MARK = "most recent call first"
"""faulthandler's header line of each thread's stack."""


def wait_exit(pids: Iterable[int], timeout: float) -> None:
    """Return once one of ``pids`` has exited (a zombie counts), or after ``timeout``.

    Each pid's pidfd turns readable when it exits, so the supervisor learns of a failed rank
    at once instead of at its next poll: every millisecond of it is one the survivors wait
    for their replacement. Without pidfds (not Linux, a kernel before 5.3) it sleeps."""
    fds: list[int] = []
    try:
        for pid in pids:
            try:
                fds.append(os.pidfd_open(pid))
            except ProcessLookupError:
                return  # already reaped: gone
        if fds:
            select.select(fds, [], [], timeout)
            return
    except (AttributeError, OSError):  # no pidfd_open, or the kernel refuses it
        pass
    finally:
        for fd in fds:
            os.close(fd)
    time.sleep(timeout)


def file_size(path: str | None) -> int:
    try:
        return os.path.getsize(path) if path else 0
    except OSError:
        return 0


def read_from(path: str | None, offset: int) -> str:
    """What was appended to ``path`` after ``offset`` bytes."""
    if not path:
        return ""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            return fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def stderr_tail(path: str | None, max_bytes: int = 8192) -> str:
    """The last ``max_bytes`` of a worker's tee'd stderr file."""
    if not path:
        return ""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            return fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
