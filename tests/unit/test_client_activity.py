"""A rank's work, read from /proc: what tells a stuck loader from a refilling one."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from trainguard.client import activity
from trainguard.client.activity import Activity, Reading, busy
from trainguard.core.rankstate import QUIET_LOOK_AFTER_S, RankState


def test_work_is_cpu_above_its_share_or_any_byte_or_a_new_child_or_a_read_in_flight(
        ) -> None:
    before = Reading({"self": (1.0, 100), "42": (2.0, 5)})
    assert not busy(before, Reading({"self": (1.01, 100), "42": (2.0, 5)}), 1.0)
    assert busy(before, Reading({"self": (1.2, 100), "42": (2.0, 5)}), 1.0)
    assert busy(before, Reading({"self": (1.0, 100), "42": (2.0, 6)}), 1.0)
    assert busy(before, Reading({**before.work, "43": (0.0, 0)}), 1.0)  # a worker started
    assert not busy(before, Reading({"self": (1.0, 100)}), 1.0)  # a worker ended
    assert busy(before, Reading(before.work, in_io=True), 1.0)  # a slow read, still waiting


class Script:
    """Readings handed out in order (the last one repeated)."""

    def __init__(self, *readings: Reading | None) -> None:
        self.readings = list(readings)

    def __call__(self) -> Reading | None:
        return self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]


def test_quiet_counts_from_the_first_look_and_a_new_phase_starts_over() -> None:
    same = Reading({"self": (1.0, 0)})
    watch = Activity(Script(same))
    t0 = 100.0
    assert watch.look(t0, t0 + 0.3) == 0.0  # the first look only reads
    assert watch.look(t0, t0 + 0.6) == pytest.approx(0.3)
    assert watch.look(t0, t0 + 1.3) == pytest.approx(1.0)
    assert watch.said(t0) == pytest.approx(1.0)
    assert watch.said(t0 + 1.25) == 0.0  # a beat of the next phase, before its first look
    assert watch.look(t0 + 1.4, t0 + 1.7) == 0.0  # the next phase
    assert watch.look(None, t0 + 1.8) == 0.0  # between steps


def test_work_resets_the_quiet_and_an_unreadable_process_is_never_quiet() -> None:
    t0 = 0.0
    watch = Activity(Script(*(Reading({"self": (1.0, b)}) for b in (0, 0, 10, 10))))
    watch.look(t0, 0.3)
    assert watch.look(t0, 0.6) == pytest.approx(0.3)
    assert watch.look(t0, 0.9) == 0.0  # bytes moved
    assert watch.look(t0, 1.2) == pytest.approx(0.3)
    blind = Activity(Script(None))
    assert [blind.look(t0, t) for t in (0.3, 0.6, 2.0)] == [0.0, 0.0, 0.0]


def test_a_phase_is_looked_at_once_older_than_a_tenth_of_a_second_and_the_usual_step(
        ) -> None:
    state = RankState()
    assert state.looked_at(time.monotonic() + 10) is None  # between steps
    state.begin_step(1)
    state.enter("data")
    t0 = state.phase_t0
    assert state.looked_at(t0 + QUIET_LOOK_AFTER_S / 2) is None
    assert state.looked_at(t0 + 1.01 * QUIET_LOOK_AFTER_S) == t0
    state.usual_step = 2.0  # a job of 2 s steps: a phase is long past a whole step
    assert state.looked_at(t0 + 1.0) is None and state.looked_at(t0 + 2.0) == t0
    with state.collective():
        assert state.looked_at(t0 + 10) is None


# -- real readings ------------------------------------------------------------------------

def looked_from_own_thread(fn: Callable[[], bool]) -> bool:
    """Runs ``fn`` on a trainguard-named thread, as the transport thread reads."""
    out: list[bool] = []
    t = threading.Thread(target=lambda: out.append(fn()), name="trainguard-test-look")
    t.start()
    t.join(30)
    return out[0]


def window(seconds: float = 0.4) -> bool:
    """Two readings ``seconds`` apart: did anything work between them?"""
    before = activity.read()
    assert before is not None
    time.sleep(seconds)  # the window looked at, not a wait for anything
    after = activity.read()
    assert after is not None
    return busy(before, after, seconds)


def busy_within(timeout: float = 20.0) -> bool:
    """Work seen between two readings, looked for until ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if window(0.3):
            return True
    return False


@pytest.fixture
def child() -> Iterator[Callable[[str], subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []

    def start(code: str) -> subprocess.Popen[bytes]:
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        assert p.stdout is not None and p.stdout.readline() == b"up\n"
        started.append(p)
        return p

    yield start
    for p in started:
        p.kill()
        p.wait(10)
        assert p.stdout is not None
        p.stdout.close()


UP = "import sys; sys.stdout.write('up\\n'); sys.stdout.flush()\n"


QUIET_IN_A_FRESH_PROCESS = """
import subprocess, sys, threading, time
from trainguard.client.activity import busy, read

if sys.argv[1] == "child":  # a loader worker waiting on nothing
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
else:  # trainguard's own thread burning CPU
    def spin():
        while True:
            sum(range(1000))
    threading.Thread(target=spin, name="trainguard-busy", daemon=True).start()
seen = []

def look():
    for _ in range(5):
        before = read()
        time.sleep(0.4)
        if not busy(before, read(), 0.4):
            seen.append("quiet")
            return

t = threading.Thread(target=look, name="trainguard-look")
t.start()
t.join()
if sys.argv[1] == "child":
    worker.kill()
print(seen[0] if seen else "busy")
"""


@pytest.mark.parametrize("case", ["child", "own-thread"])
def test_a_process_waiting_on_nothing_is_quiet_whatever_trainguard_does(case: str) -> None:
    """In a process of its own (this one runs other tests' threads and children): a child
    waiting on nothing, or trainguard's own thread burning CPU, is no work. Quiet is the
    rare outcome on a busy machine: a few windows, one quiet is proof."""
    out = subprocess.run([sys.executable, "-c", QUIET_IN_A_FRESH_PROCESS, case],
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "quiet", out.stderr


def test_a_loader_worker_burning_cpu_is_work(
        child: Callable[[str], subprocess.Popen[bytes]]) -> None:
    child(UP + "while True: pass")
    assert looked_from_own_thread(busy_within)


def test_a_loader_worker_reading_is_work(
        child: Callable[[str], subprocess.Popen[bytes]]) -> None:
    child(UP + "import time\nwhile True:\n    open('/proc/self/stat').read(); time.sleep(0.05)")
    assert looked_from_own_thread(busy_within)


@contextlib.contextmanager
def spinning(name: str) -> Iterator[None]:
    """A thread named ``name`` burning CPU meanwhile."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    t = threading.Thread(target=spin, name=name)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(10)


def test_the_trainers_own_thread_working_is_work() -> None:
    with spinning("loader-prefetch"):
        assert looked_from_own_thread(busy_within)
