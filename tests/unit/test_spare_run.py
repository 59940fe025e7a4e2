"""A warm spare runs a script as ``python script.py`` would: the exit code, and the
script's objects alive through its ``atexit`` handlers (a rank's process group must not
close before the Guard flushed, or its peers fail first and the crash looks like theirs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import atexit
class Group:
    def __del__(self):
        print("group closed", flush=True)
def main():
    group = Group()
    atexit.register(print, "atexit flush", flush=True)
    raise RuntimeError("boom")
main()
"""
IN_SPARE = """
import sys
from trainguard.agent.spare import SpareOrder, _run
sys.exit(_run(SpareOrder(env={}, argv=[sys.argv[1]], cwd=".", stdout="", stderr="",
                         script=sys.argv[1])))
"""


def test_a_script_in_a_spare_exits_and_cleans_up_as_under_python(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                           timeout=60)
    spare = subprocess.run([sys.executable, "-c", IN_SPARE, str(script)], capture_output=True,
                           text=True, timeout=60)
    assert plain.stdout.split("\n")[:2] == ["atexit flush", "group closed"]
    assert (spare.returncode, spare.stdout) == (plain.returncode, plain.stdout) == (1, plain.stdout)
    assert "RuntimeError: boom" in spare.stderr
