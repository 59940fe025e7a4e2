"""Whether a process of this host is alive: a detector's name claim and a launch's log
directory are kept while their process runs."""

from __future__ import annotations

import os


def pid_running(pid: int) -> bool:
    """Whether ``pid`` is a live process of this host (a zombie is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            stat = fh.read()
    except OSError:
        return True  # no /proc: trust kill(0)
    return stat[stat.rfind(")") + 2: stat.rfind(")") + 3] != "Z"
