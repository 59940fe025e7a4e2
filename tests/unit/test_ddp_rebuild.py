"""``trainguard.torch.ddp`` on a one-rank gloo group (no peers needed)."""

from __future__ import annotations

import datetime
import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

from trainguard import Guard
from trainguard.runtime.embedded import free_port
from trainguard.torch import ddp


def test_closing_the_guard_frees_the_ddp_while_its_group_is_up() -> None:
    """Left to the interpreter's exit (after destroy_process_group), a DDP's teardown can
    abort the process: the guard's close frees it first."""
    guard = Guard(job="ddpjob", rank=0, world_size=1, host="h",
                  nats_url=f"nats://127.0.0.1:{free_port()}", heartbeat_interval=60)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        model = ddp(nn.Linear(4, 2), guard)
        model(torch.randn(3, 4)).sum().backward()  # type: ignore[no-untyped-call]
        built = weakref.ref(model.ddp)
        assert built() is not None
        guard.close(timeout=0.1)
        gc.collect()
        assert built() is None
        with pytest.raises(RuntimeError, match="not built"):
            model.ddp  # noqa: B018
        assert set(model.state_dict()) == {"module.weight", "module.bias"}
    finally:
        dist.destroy_process_group()
