"""A crash ends the process once the Guard flushed (:mod:`trainguard.client.fastexit`):
real child interpreters, their exit status, output and exit handlers."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CHILD = textwrap.dedent("""
    import atexit, pathlib, sys
    from trainguard.client import fastexit
    out = pathlib.Path(sys.argv[1])
    atexit.register(lambda: (out / "atexit").write_text("ran"))
    fastexit.install(lambda: (out / "stale").write_text("replaced"))
    fastexit.install(lambda: (out / "flushed").write_text("ran"))  # the newest flush
    kind = sys.argv[2]
    if kind == "wrapped":  # what every init_process_group does to sys.excepthook
        below = sys.excepthook
        def collecting(*args):
            import io
            saved, sys.stderr = sys.stderr, io.StringIO()
            try:
                below(*args)
            finally:
                text, sys.stderr = sys.stderr.getvalue(), saved
            sys.stderr.write("".join(f"[rank0]: {line}" for line in text.splitlines(True)))
        sys.excepthook = collecting
    if kind in ("error", "wrapped"):
        raise RuntimeError("injected crash")
    if kind == "interrupt":
        raise KeyboardInterrupt
    sys.exit(3)
""")


def run(tmp_path: Path, kind: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), kind],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("kind", ["error", "wrapped"])
def test_an_unhandled_error_prints_its_traceback_flushes_and_ends_at_once(
        tmp_path: Path, kind: str) -> None:
    done = run(tmp_path, kind)
    assert done.returncode == 1, done.stderr
    assert "RuntimeError: injected crash" in done.stderr  # the traceback came first
    assert "RuntimeError ended this rank" in done.stderr
    assert (tmp_path / "flushed").read_text() == "ran"
    assert not (tmp_path / "stale").exists()
    assert not (tmp_path / "atexit").exists()  # the point: no interpreter teardown


@pytest.mark.parametrize(("kind", "code"), [("interrupt", -2), ("exit", 3)])
def test_an_interrupt_or_an_exit_ends_as_always(tmp_path: Path, kind: str, code: int) -> None:
    done = run(tmp_path, kind)
    assert done.returncode == code, done.stderr
    assert (tmp_path / "atexit").read_text() == "ran"
    assert not (tmp_path / "flushed").exists()
