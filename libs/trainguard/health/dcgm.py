"""``dcgmi diag -r <level>``: run it where DCGM is installed, and read its table.

The text report is a table of ``| test | result |`` rows grouped under ``Deployment``,
``Integration``, ``Hardware`` and ``Stress`` headings; a result starts with ``Pass``,
``Fail``, ``Warn`` or ``Skip`` (``Pass - All``, ``Fail - GPU: 0``), and the ``Warning`` /
``Info`` rows after a test say why (NVIDIA's DCGM user guide, "DCGM Diagnostics").
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field

_ROW = re.compile(r"^\|\s*(.*?)\s*\|\s*(.*?)\s*\|\s*$")
RESULTS = ("pass", "fail", "warn", "skip")


@dataclass
class DiagTest:
    name: str
    result: str
    """``pass``, ``fail``, ``warn`` or ``skip``."""
    detail: str = ""
    notes: list[str] = field(default_factory=list)


def parse(text: str) -> list[DiagTest]:
    """The tests of a ``dcgmi diag`` table, with the Warning/Info lines that follow each;
    metadata rows (versions, device ids) are left out."""
    tests: list[DiagTest] = []
    for line in text.splitlines():
        m = _ROW.match(line.strip())
        if not m:
            continue
        name, value = m.group(1), m.group(2)
        if name.lower() in ("warning", "info") or (not name and tests):
            if tests and value:
                tests[-1].notes.append(value)
            continue
        word = value.split()[0].lower().rstrip(",") if value else ""
        if word in RESULTS:
            tests.append(DiagTest(name=name, result=word, detail=value))
    return tests


@dataclass(frozen=True)
class Run:
    """One run of dcgmi: its output, or why there is none."""

    output: str = ""
    missing: str = ""
    """Why it did not run (no dcgmi on the PATH)."""
    error: str = ""
    """It ran and failed to produce a report (host engine not running, timeout)."""


def run(level: int, timeout: float, binary: str = "dcgmi") -> Run:
    path = shutil.which(binary)
    if path is None:
        return Run(missing=f"{binary} is not installed (DCGM absent)")
    try:
        done = subprocess.run([path, "diag", "-r", str(level)], capture_output=True,
                              text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return Run(error=f"dcgmi diag -r {level} ran past {timeout:g} s")
    out = done.stdout + done.stderr
    if not parse(out):
        return Run(output=out, error=f"dcgmi diag -r {level} exited {done.returncode} with no "
                   f"results: {out.strip().splitlines()[-1][:200] if out.strip() else ''}")
    return Run(output=out)
