"""The pre-flight's NVML checks and NCCL bandwidth test on a real GPU node; prints the
record (JSON) and the table. Run on a machine with GPUs:

    PYTHONPATH=libs python scripts/device_preflight.py [--procs N] [--mb 256]

Exit 0 when no check failed. Needs nvidia-ml-py and torch with CUDA.
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile

from trainguard.agent.gpu import open_source
from trainguard.contract.codec import encode_durable
from trainguard.health import preflight
from trainguard.health.settings import PreflightSettings
from trainguard.runtime.config import load_settings


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--procs", type=int, default=0, help="ranks (0: one per GPU)")
    p.add_argument("--mb", type=float, default=256.0)
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="tg-device-preflight-") as root:
        settings = load_settings(PreflightSettings, env={}, overrides={
            "preflight_checks": "nvml,dcgm,ib,allreduce,disk", "checkpoint_root": root,
            "preflight_allreduce_procs": a.procs, "preflight_allreduce_mb": a.mb,
            "preflight_allreduce_iters": a.iters})
        source, why = open_source()
        print(f"gpu source: {why}", flush=True)
        gpus = source.sample() if source is not None else None
        if source is not None:
            source.close()
        report = preflight.run(settings, job="device", host=socket.gethostname().split(".")[0],
                               gpus=gpus, gpu_why=why, trigger="cli")
    print(encode_durable(report).decode())
    print(preflight.render(report))
    return 1 if report.status == "fail" else 0


if __name__ == "__main__":
    sys.exit(main())
