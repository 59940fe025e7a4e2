"""Rank connections with per-rank JWT credentials against the shared rank password.

Two nats-server processes in the same run: one with the static users of
``trainguard.core.auth`` (every rank logs in as the ``rank`` user with its password), one
in operator mode (``trainguard.core.identities``: each rank presents its own ``.creds``,
minted beforehand; minting is timed on its own). For each N, each mode opens N
connections from a few processes with asyncio (at most ``--inflight`` connecting at once
per process, as ranks starting together would; timed from when every process has started),
and a connection counts as ready once
connected and its first heartbeat PUB is flushed (the server has read it, so the
permission check ran). All N stay open until the last is ready. Modes alternate in
rounds, each started once both servers are idle (a server finishes closing the last
round's connections after its clients have gone); reported: the median wall time to N
ready per mode, the ratio, the server's CPU time per connection (open and close) and the
clients' (from start to ready) per mode, and the JWT mint cost per credential.

    python bench/bench_connect.py --ns 1024,8192 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import nats

from trainguard.core.auth import access_from, generate, nats_authorization
from trainguard.core.identities import Trust
from trainguard.runtime.embedded import NatsServer, free_port

PREFIX, JOB = "tg", "bench"
RETRIES = 5
"""A connect the server ended (on a loaded machine, a CONNECT later than its 2 s auth
timeout) is tried again, up to this many times, and counted."""


async def _quiet(_: Exception) -> None:
    """nats-py's ``error_cb``: a failed connect is counted and retried, not printed."""


def _open(url: str, options: list[dict[str, Any]], inflight: int, go: Any, ready: Any,
          out: Any) -> None:
    """One client process: once ``go`` is set, open every connection in ``options``, report
    when all are ready, hold them until ``ready`` (every process's) is set, then close."""

    async def main() -> None:
        gate = asyncio.Semaphore(inflight)
        conns: list[Any] = []
        retried = 0

        async def one(opts: dict[str, Any]) -> None:
            nonlocal retried
            rank = opts.pop("_rank")
            async with gate:
                for attempt in range(RETRIES + 1):
                    try:
                        nc = await nats.connect(url, allow_reconnect=False, connect_timeout=60,
                                                error_cb=_quiet, **opts)
                        break
                    except Exception:
                        if attempt == RETRIES:
                            raise
                        retried += 1
                await nc.publish(f"{PREFIX}.{JOB}.hb.{rank}", b"x")
                await nc.flush(timeout=60)
                conns.append(nc)

        ranks = [dict(o) for o in options]
        out.put(("imported", 0.0, 0.0, 0))
        await asyncio.to_thread(go.wait)
        cpu = time.process_time()
        await asyncio.gather(*(one(o) for o in ranks))
        out.put(("ready", time.time(), time.process_time() - cpu, retried))
        await asyncio.to_thread(ready.wait)
        for nc in conns:
            with contextlib.suppress(Exception):
                await nc.close()

    asyncio.run(main())


def server_cpu(pid: int) -> float:
    """CPU seconds (user + system) the server process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def settle(pids: list[int], quiet: float = 0.01, window: float = 0.25,
           limit: float = 60.0) -> None:
    """Wait until the processes ``pids`` together use under ``quiet`` of a core, so that
    one round's leftover work (closing its connections) never runs in another's time."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        before = sum(server_cpu(p) for p in pids)
        time.sleep(window)
        if sum(server_cpu(p) for p in pids) - before < quiet * window:
            return


def _next(out: Any, workers: list[Any], limit: float) -> tuple[Any, ...]:
    """The next report from ``workers``; raises at once if one of them has died."""
    deadline = time.monotonic() + limit
    while True:
        with contextlib.suppress(queue.Empty):
            return tuple(out.get(timeout=1.0))
        if any(w.exitcode not in (None, 0) for w in workers):
            raise RuntimeError("a client process failed (see its traceback above)")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no report from the client processes in {limit:.0f} s")


def run_mode(url: str, options: list[dict[str, Any]], procs: int,
             inflight: int) -> tuple[float, float, int]:
    """Seconds from the start until every connection is ready (all processes together),
    the client processes' CPU seconds over that time, and the connects tried again."""
    ctx = mp.get_context("spawn")
    go, ready, out = ctx.Event(), ctx.Event(), ctx.Queue()
    parts = [options[i::procs] for i in range(procs)]
    workers = [ctx.Process(target=_open, args=(url, part, inflight, go, ready, out),
                           daemon=True) for part in parts]
    for w in workers:
        w.start()
    for _ in workers:  # every process has imported nats-py: its start is not timed
        _next(out, workers, 120)
    started = time.time()
    go.set()
    finished = [_next(out, workers, 600)[1:] for _ in workers]
    ready.set()
    for w in workers:
        w.join(60)
        if w.is_alive():
            w.kill()
    return (max(f[0] for f in finished) - started, sum(f[1] for f in finished),
            sum(f[2] for f in finished))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ns", default="256,1024,4096,8192")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--inflight", type=int, default=64)
    ap.add_argument("--out", default="", help="write the results here too (JSON)")
    args = ap.parse_args()
    ns = [int(n) for n in args.ns.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        creds = generate(("rank",))
        secret = creds["rank"].nats
        assert secret is not None
        static = NatsServer(free_port(), root / "static",
                            auth=nats_authorization(creds, PREFIX) + "max_connections: 65536\n")
        trust = Trust.new()
        operator = NatsServer(free_port(), root / "jwt",
                              auth=trust.server_config(root / "jwt" / "jwt")
                              + "max_connections: 65536\n")
        static.start()
        operator.start()
        try:
            minter = trust.minter
            t0 = time.perf_counter()
            files = []
            for r in range(max(ns)):
                path = root / f"rank-{r}.creds"
                path.write_text(minter.mint_rank(PREFIX, JOB, r, ttl=3600))
                files.append(str(path))
            mint_us = (time.perf_counter() - t0) / max(ns) * 1e6
            print(f"mint: {mint_us:.0f} us per rank credential (JWT + nkey + file)", flush=True)
            results: dict[int, dict[str, list[float]]] = {}
            for n in ns:
                modes: dict[str, tuple[str, list[dict[str, Any]]]] = {
                    "password": (static.url, [{"user": secret.user, "password": secret.password,
                                               "_rank": r} for r in range(n)]),
                    # What a rank's Guard passes: trainguard.core.auth.Access.nats_options.
                    "jwt": (operator.url, [{**access_from(files[r]).nats_options(), "_rank": r}
                                           for r in range(n)]),
                }
                pids = {"password": static.pid, "jwt": operator.pid}
                times: dict[str, list[float]] = {m: [] for m in modes}
                cpu: dict[str, list[float]] = {m: [] for m in modes}
                client: dict[str, list[float]] = {m: [] for m in modes}
                retried = dict.fromkeys(modes, 0)
                for i in range(args.rounds):
                    order = list(modes) if i % 2 == 0 else list(reversed(modes))
                    for m in order:
                        url, options = modes[m]
                        settle([p for p in pids.values() if p])
                        before = server_cpu(pids[m] or 0)
                        wall, client_cpu, again = run_mode(url, options, args.procs,
                                                           args.inflight)
                        retried[m] += again
                        settle([pids[m] or 0])  # its connections' closing counts too
                        cpu[m].append(server_cpu(pids[m] or 0) - before)
                        times[m].append(wall)
                        client[m].append(client_cpu)
                results[n] = {**times, **{f"{m} server cpu": c for m, c in cpu.items()},
                              **{f"{m} client cpu": c for m, c in client.items()}}
                pw, jw = statistics.median(times["password"]), statistics.median(times["jwt"])
                pc, jc = statistics.median(cpu["password"]), statistics.median(cpu["jwt"])
                pk, jk = statistics.median(client["password"]), statistics.median(client["jwt"])
                print(f"N={n:5d}  password {pw:7.2f} s   jwt {jw:7.2f} s   ratio "
                      f"{jw / pw:5.2f}   server cpu per connection: password "
                      f"{pc / n * 1e6:4.0f} us, jwt {jc / n * 1e6:4.0f} us   client cpu: "
                      f"password {pk / n * 1e6:4.0f} us, jwt {jk / n * 1e6:4.0f} us   (rounds: "
                      f"password {', '.join(f'{t:.2f}' for t in times['password'])}; jwt "
                      f"{', '.join(f'{t:.2f}' for t in times['jwt'])}; load average "
                      f"{os.getloadavg()[0]:.1f}; connects retried: password "
                      f"{retried['password']}, jwt {retried['jwt']})", flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps({"mint_us": mint_us, "results": {
                    str(n): t for n, t in results.items()}}, indent=2))
        finally:
            operator.stop()
            static.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
