"""Reading device tensors without a host sync: pinned copy + CUDA event."""

from __future__ import annotations

import torch


class DeviceValue:
    """A 0-dim (or small) device tensor being copied to pinned host memory.

    ``ready()`` polls the event (never blocks); ``value()`` reads the host copy, waiting
    only if asked before the copy finished (the Guard never does, except at close).
    """

    __slots__ = ("event", "host")

    def __init__(self, tensor: torch.Tensor) -> None:
        t = tensor.detach()
        self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.host.copy_(t, non_blocking=True)
        self.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self.event.record()

    def ready(self) -> bool:
        return bool(self.event.query())  # type: ignore[no-untyped-call]

    def value(self) -> float:
        if not self.event.query():  # type: ignore[no-untyped-call]
            self.event.synchronize()
        return float(self.host.reshape(-1)[0].item()) if self.host.numel() else float("nan")


class CpuValue:
    __slots__ = ("_value",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self._value = float(tensor.detach().reshape(-1)[0].item())

    def ready(self) -> bool:
        return True

    def value(self) -> float:
        return self._value


def defer_tensor(tensor: torch.Tensor) -> DeviceValue | CpuValue:
    if tensor.device.type == "cuda":
        return DeviceValue(tensor)
    return CpuValue(tensor)
