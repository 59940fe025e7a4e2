"""Metric values that may be tensors, read without forcing a GPU sync on the hot path.

A Python number is used as it is. A CPU tensor is read with ``item()`` (no device to
wait for). A CUDA tensor is copied to pinned host memory with ``non_blocking=True`` and
an event is recorded after the copy; the value is read once the event has completed,
which the Guard checks at later safe points (``Event.query()`` never blocks). The client
itself never imports torch: it only recognises tensors the trainer hands it.
"""

from __future__ import annotations

from typing import Any, Protocol


class Deferred(Protocol):
    def ready(self) -> bool: ...

    def value(self) -> float: ...


def is_tensor(value: object) -> bool:
    return type(value).__module__ == "torch" and hasattr(value, "device")


def read_number(value: Any) -> float | Deferred | None:
    """A float now, a :class:`Deferred` for a device tensor, or None for None."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if is_tensor(value):
        if value.device.type == "cpu":
            return float(value.detach().item())
        from trainguard.torch.values import defer_tensor

        return defer_tensor(value)
    return float(value)



def plain_float(value: Any) -> float | None:
    """``value`` as a float when it is a plain number (not a bool, not a tensor: reading a
    tensor could wait for the device)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else None


def optimizer_lr(optimizer: Any) -> float | None:
    """The learning rate of ``optimizer``'s first parameter group, when it is a plain
    number (a tensor LR is skipped: reading it could wait for the device)."""
    groups = getattr(optimizer, "param_groups", None)
    if not groups:
        return None
    try:
        lr = groups[0].get("lr")
    except (AttributeError, TypeError):
        return None
    return plain_float(lr)
