"""One rank of the node-local all-reduce bandwidth test (``python -m
trainguard.health.allreduce``): started by :mod:`.bandwidth`, one process per device.

Each rank all-reduces a buffer of ones ``iters`` times after a warm-up; rank 0 prints one
JSON line: the bus bandwidth (NCCL's convention, algorithm bandwidth x 2(n-1)/n, so numbers
compare across rank counts) and whether the sums came out exact (a link that corrupts data
is no faster for being quick).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import timedelta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--init", required=True, help="file:// rendezvous path")
    p.add_argument("--backend", choices=("nccl", "gloo"), required=True)
    p.add_argument("--mb", type=float, required=True)
    p.add_argument("--iters", type=int, required=True)
    p.add_argument("--timeout", type=float, default=60.0)
    a = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    dist.init_process_group(a.backend, init_method=a.init, rank=a.rank, world_size=a.world,
                            timeout=timedelta(seconds=a.timeout))
    device = torch.device("cuda", a.rank) if a.backend == "nccl" else torch.device("cpu")
    if a.backend == "nccl":
        torch.cuda.set_device(device)
    elements = max(1, int(a.mb * 1024 * 1024 // 4))
    x = torch.ones(elements, dtype=torch.float32, device=device)

    def sync() -> None:
        if a.backend == "nccl":
            torch.cuda.synchronize(device)

    dist.all_reduce(x)  # warm-up: connections, buffers
    sync()
    x.fill_(1.0)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(a.iters):
        dist.all_reduce(x)
    sync()
    seconds = time.perf_counter() - start
    expect = float(a.world) ** a.iters
    exact = bool(torch.all(x == expect).item())
    if a.rank == 0:
        size = elements * 4
        algbw = size * a.iters / seconds / 1e9
        busbw = algbw * 2 * (a.world - 1) / a.world
        print(json.dumps({"busbw_gbps": round(busbw, 3), "algbw_gbps": round(algbw, 3),
                          "seconds": round(seconds, 4), "exact": exact, "ranks": a.world,
                          "bytes": size, "backend": a.backend}), flush=True)
    dist.destroy_process_group()
    return 0 if exact else 3


if __name__ == "__main__":
    sys.exit(main())
