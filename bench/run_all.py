"""``make bench``: run every benchmark, print their tables, save bench/results/<date>.json.

Every ``bench_*.py`` here runs (bench_preflight: a healthy node's pre-flight, target 30 s).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def machine() -> str:
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, " \
           f"Python {platform.python_version()}, {platform.system()}"


def main() -> int:
    results: dict[str, object] = {"date": dt.date.today().isoformat(), "machine": machine()}
    failed = []
    for script in sorted(HERE.glob("bench_*.py")):
        name = script.stem.removeprefix("bench_")
        print(f"\n## {name}\n", flush=True)
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            proc = subprocess.run([sys.executable, str(script), "--out", out.name], check=False)
            if proc.returncode != 0:
                failed.append(name)
                continue
            results[name] = json.loads(Path(out.name).read_text() or "{}")
    dest = HERE / "results" / f"{results['date']}.json"
    dest.parent.mkdir(exist_ok=True)
    dest.write_text(json.dumps(results, indent=2))
    print(f"\nmachine: {results['machine']}\nresults: {dest}")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
