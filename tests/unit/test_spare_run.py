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


TRAINER = """
import json
import yaml
import sidefx
from tomlkit import dumps, api
def main(): ...
"""
PRELOAD = """
import sys
from trainguard.agent.spare import preload
print(preload(sys.argv[1], sys.argv[2] == "module"))
print(sorted(m for m in ("yaml", "tomlkit", "tomlkit.api", "sidefx", "pkg") if m in sys.modules))
"""


def test_a_spare_preloads_the_trainers_installed_imports_and_nothing_of_the_users(
        tmp_path: Path) -> None:
    """A replacement skips the framework's import; the user's own modules (which may read
    the rank's environment at import, not the spare's yet) and packages stay unimported."""
    (tmp_path / "sidefx.py").write_text("open('imported', 'w').write('sidefx')\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("open('imported', 'w').write('pkg')\n")
    (tmp_path / "pkg" / "train.py").write_text(TRAINER)
    (tmp_path / "train.py").write_text(TRAINER)
    for target, how in (("train.py", "script"), ("pkg.train", "module")):
        out = subprocess.run([sys.executable, "-c", PRELOAD, target, how], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120, check=True).stdout
        assert out.splitlines() == ["['yaml', 'tomlkit']", "['tomlkit', 'tomlkit.api', 'yaml']"]
        assert not (tmp_path / "imported").exists()
