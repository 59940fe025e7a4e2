"""Dashboard: first paint, update latency and bytes per update in headless Chromium, at
1,024, 4,096 and 16,384 ranks, the grouped view beside the per-rank table it replaced.

A board is fed the detector's synthetic job (hosts of 8 ranks, 40 steps, one straggler,
then one rank stuck in ``data`` while the others wait in ``comm``) and served by the real
``DashboardServer`` on loopback; a real headless Chromium (``tests/e2e/browser.py``) loads
the page. Two pages in the same run, on the same board:

* ``grouped``: the packaged page, rendering ``/api/summary`` (what its event stream sends);
* ``per-rank``: the page before the grouped view (``--old-page``, e.g. ``git show
  ce1254b~1:libs/trainguard/dashboard/static/index.html``), rendering ``/api/state``,
  every rank with its 40-step strip (what its event stream sent).

Measured in the page (``performance.now()``). *First paint*: for the grouped page, from
navigation start to its first render from its own event stream (the server builds the
summary on connecting); the per-rank page's stream no longer carries its state, so its
first paint is a fetch of ``/api/state``, parse, render and the next frame on the freshly
loaded page (page load not included: it favours the baseline). *Update*: fetch (the server
builds the state again after a change to the board, an agent's node heartbeat), parse,
render and the next frame, the median of ``--updates``. Also the
server's build time of one update (in Python), its bytes, and for the grouped page the
time to open the heat map (``/api/cells`` fetched and drawn, one cell per rank).

Run: ``PYTHONPATH=libs:. .venv/bin/python bench/bench_dashboard.py --old-page OLD.html
[--ranks 1024 4096 16384] [--out results.json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.e2e.browser import Browser, ensure_chromium
from trainguard.contract.schemas import NodeHeartbeat
from trainguard.dashboard import Board, DashboardServer
from trainguard.dashboard.board import to_json
from trainguard.services.detector.synthetic import SimConfig, SimJob

JOB = "bench"
STEPS = 40

MEASURE = """
const [url] = arguments;
return (async () => {
  const t0 = performance.now();
  const text = await (await fetch(url, {cache: "no-store"})).text();
  const t1 = performance.now();
  render(JSON.parse(text));
  await new Promise(r => requestAnimationFrame(() => setTimeout(r, 0)));
  return {ms: performance.now() - t0, fetch_ms: t1 - t0, bytes: text.length,
          elements: document.getElementsByTagName("*").length};
})();
"""

PAINTED = """
return (async () => {
  while (window.trainguardPainted === undefined)
    await new Promise(r => setTimeout(r, 5));
  return window.trainguardPainted;
})();
"""

OPEN_MAP = """
const [job, n] = arguments;
return (async () => {
  const t0 = performance.now();
  document.querySelector(`[data-heatmap-toggle="${job}"]`).click();
  while (true) {
    const c = document.querySelector(`canvas[data-heatmap="${job}"]`);
    if (c && Number(c.dataset.cells) === n) break;
    await new Promise(r => requestAnimationFrame(r));
  }
  await new Promise(r => requestAnimationFrame(() => setTimeout(r, 0)));
  return performance.now() - t0;
})();
"""


def fed_board(ranks: int) -> tuple[Board, SimJob]:
    board = Board()
    sim = SimJob(SimConfig(job=JOB, ranks=ranks, ranks_per_host=8, slow_step_prob=0.0,
                           start_time=time.time() - 120), board.telemetry)
    sim.slow[ranks // 3] = 1.8
    sim.steps(STEPS)
    sim.stall(8.0, lambda r: "data" if r == ranks // 2 else "comm")
    return board, sim


def bump(board: Board, sim: SimJob) -> None:
    """One change the page must show: a node heartbeat (the hung rank's host's agent)."""
    sim.now += 0.5
    board.telemetry(NodeHeartbeat(job=JOB, host=sim.host(sim.cfg.ranks // 2), time=sim.now,
                                  ranks={sim.cfg.ranks // 2: "S"}))


def build_ms(fn: Any) -> tuple[float, int]:
    t = time.perf_counter()
    body = to_json(fn(time.time()))
    return (time.perf_counter() - t) * 1000, len(body)


async def one_page(browser: Browser, board: Board, sim: SimJob, html: bytes | None,
                   api: str, updates: int) -> dict[str, Any]:
    server = DashboardServer(board, html=html)
    await server.start("127.0.0.1", 0)
    try:
        base = f"http://127.0.0.1:{server.port}/"
        await asyncio.to_thread(browser.get, base)
        painted = await asyncio.to_thread(browser.run, PAINTED) if html is None else None
        first = await asyncio.to_thread(browser.run, MEASURE, base + api)
        times = []
        for _ in range(updates):
            bump(board, sim)
            times.append((await asyncio.to_thread(browser.run, MEASURE, base + api))["ms"])
        out = {"first_paint_ms": round(painted if painted is not None else first["ms"]),
               "update_ms": round(statistics.median(times)), "update_max_ms": round(max(times)),
               "bytes_per_update": first["bytes"],
               "elements": first["elements"]}
        if html is None:
            out["heatmap_open_ms"] = round(await asyncio.to_thread(
                browser.run, OPEN_MAP, JOB, sim.cfg.ranks))
        return out
    finally:
        await asyncio.to_thread(browser.get, "about:blank")  # its event stream ends first
        await server.stop()


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    old = Path(args.old_page).read_bytes() if args.old_page else None
    results: list[dict[str, Any]] = []
    for n in args.ranks:
        t = time.perf_counter()
        board, sim = fed_board(n)
        fed_s = time.perf_counter() - t
        summary_ms, summary_bytes = build_ms(board.summary)
        cells = to_json(board.cells(JOB) or {})
        row: dict[str, Any] = {"ranks": n, "fed_s": round(fed_s, 1)}
        browser = Browser(width=1400, height=900)
        browser.script_timeout(110)  # the per-rank page takes long at 16k ranks
        try:
            row["grouped"] = {"build_ms": round(summary_ms), "json_bytes": summary_bytes,
                              "cells_bytes": len(cells),
                              **await one_page(browser, board, sim, None, "api/summary",
                                               args.updates)}
            if old is not None:
                state_ms, state_bytes = build_ms(board.snapshot)
                row["per_rank"] = {"build_ms": round(state_ms), "json_bytes": state_bytes,
                                   **await one_page(browser, board, sim, old, "api/state",
                                                    args.updates)}
        finally:
            browser.close()
        print(json.dumps(row), flush=True)
        results.append(row)
    return {"steps_per_rank": STEPS, "results": results}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--old-page", help="the per-rank page to measure beside the grouped one")
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args()
    why = ensure_chromium()
    if why:
        print(why, file=sys.stderr)
        return 1
    out = asyncio.run(main_async(args))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
