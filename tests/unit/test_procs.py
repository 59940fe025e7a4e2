"""The agent's wait for a rank's exit (:func:`trainguard.agent.procs.wait_exit`), on real
child processes."""

from __future__ import annotations

import subprocess
import sys
import time

from trainguard.agent import procs


def test_the_wait_ends_when_a_child_exits_not_at_the_timeout() -> None:
    quick = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert quick.stdin is not None
        quick.stdin.close()  # it exits now
        t0 = time.monotonic()
        procs.wait_exit([slow.pid, quick.pid], 60.0)
        assert time.monotonic() - t0 < 30.0
        assert quick.wait(30) == 0 and slow.poll() is None
        # An exited child that no one reaped yet (a zombie) ends the wait at once too.
        t0 = time.monotonic()
        zombie = subprocess.Popen([sys.executable, "-c", "pass"])
        procs.wait_exit([zombie.pid], 60.0)
        assert time.monotonic() - t0 < 30.0 and zombie.wait(30) == 0
    finally:
        slow.kill()
        slow.wait()


def test_the_wait_times_out_when_nothing_exits_and_returns_for_a_reaped_pid() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        t0 = time.monotonic()
        procs.wait_exit([child.pid], 0.2)
        assert time.monotonic() - t0 >= 0.2 and child.poll() is None
    finally:
        child.kill()
        child.wait()
    t0 = time.monotonic()
    procs.wait_exit([child.pid], 60.0)  # reaped: pidfd_open refuses it, no wait
    assert time.monotonic() - t0 < 30.0
