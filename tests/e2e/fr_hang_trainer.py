"""A 3-rank gloo job whose rank ``--culprit`` stops outside the collective (a hang in
Python), for the flight-recorder test. Each rank watches the agent's request file the way
the Guard does (trainguard.client.frdump.Trigger, polled on a thread of its own here) and
announces itself by writing ``<dir>/ready<rank>`` (its pid) once its warm-up steps ran."""

from __future__ import annotations

import argparse
import datetime
import os
import threading
import time

import torch
import torch.distributed as dist

from trainguard.client.frdump import POLL_S, Trigger


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--culprit", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=170))
    rank = dist.get_rank()
    trigger = Trigger.from_env(rank)
    assert trigger is not None, "TRAINGUARD_FR_REQUEST and TORCH_FR_DUMP_TEMP_FILE unset"

    def watch() -> None:
        while True:
            trigger.poll()
            time.sleep(POLL_S)

    threading.Thread(target=watch, daemon=True).start()
    sub = dist.new_group([0, 1])  # a second process group, so groups are told apart
    for _ in range(args.steps):
        dist.all_reduce(torch.ones(8))
        if rank in (0, 1):
            dist.all_reduce(torch.ones(4), group=sub)
    with open(os.path.join(args.dir, f"ready{rank}"), "w") as f:
        f.write(str(os.getpid()))
    if rank == args.culprit:
        time.sleep(3600)  # stuck in Python: never reaches the next collective
    dist.all_reduce(torch.ones(8))  # everyone else waits here for the culprit


if __name__ == "__main__":
    main()
