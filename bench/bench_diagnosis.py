"""Diagnosis accuracy: the exit-text knowledge on real error lines from public threads.

Two labelled tables (tests/fixtures/): the dev set (``error-lines.jsonl`` and
``error-lines-dev.jsonl``), lines patterns were written from, and the held-out set
(``error-lines-heldout.jsonl``), lines collected after the patterns were frozen and never
used to write one. Each row is classified as one rank's crash and scored by
:mod:`trainguard.services.diagnoser.accuracy`: the fallback (``process_crash``, nothing
recognised) is right only on rows labelled ``unrecognised``. Prints accuracy per family
and overall for both sets, then every miss.

Run: ``.venv/bin/python bench/bench_diagnosis.py [--out results.json] [--misses N]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trainguard.services.diagnoser import accuracy

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
SETS = {"dev": ("error-lines.jsonl", "error-lines-dev.jsonl"),
        "held-out": ("error-lines-heldout.jsonl",)}


def rows_of(files: tuple[str, ...]) -> list[accuracy.Row]:
    return [row for name in files for row in accuracy.load(FIXTURES / name)]


def pct(right: int, total: int) -> str:
    return f"{100 * right / total:.1f}% ({right}/{total})" if total else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="")
    ap.add_argument("--misses", type=int, default=50, help="misses to print per set")
    args = ap.parse_args()
    scores = {name: accuracy.score(rows_of(files)) for name, files in SETS.items()}
    print("| family | " + " | ".join(scores) + " |")
    print("| --- |" + " --- |" * len(scores))
    for family in accuracy.FAMILIES:
        cells = [pct(s.right[family], s.total[family]) for s in scores.values()]
        print(f"| {family} | " + " | ".join(cells) + " |")
    print("| **all** | " + " | ".join(
        f"**{pct(sum(s.right.values()), sum(s.total.values()))}**" for s in scores.values())
        + " |")
    for name, s in scores.items():
        if s.misses:
            print(f"\nmisses, {name} ({len(s.misses)}):")
        for m in s.misses[:args.misses]:
            line = " ".join(m.row.text.split())[:110]
            print(f"  [{m.row.family}] want {m.row.cause}, got {m.cause}"
                  f"{'' if m.recognised else ' (fallback)'}: {line}\n    {m.row.url}")
    result = {name: {"accuracy": round(s.accuracy, 4), "rows": sum(s.total.values()),
                     "families": {f: [s.right[f], s.total[f]] for f in s.total},
                     "misses": [{"url": m.row.url, "want": m.row.cause, "got": m.cause,
                                 "text": m.row.text[:300]} for m in s.misses]}
              for name, s in scores.items()}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
