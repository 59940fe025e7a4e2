"""trainguard.torch helpers on real torch (CPU)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from trainguard.torch import (
    fingerprint,
    flip_bit,
    grad_norm,
    nonfinite,
    nonfinite_grad_names,
    poison_with_nan,
)


def small_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(100, 32), nn.Flatten(), nn.Linear(32 * 8, 64), nn.GELU(),
                         nn.Linear(64, 100))


def backward(model: nn.Module, seed: int = 1) -> None:
    torch.manual_seed(seed)
    x = torch.randint(0, 100, (16, 8))
    y = torch.randint(0, 100, (16,))
    nn.functional.cross_entropy(model(x), y).backward()


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_grad_norm_equals_clip_grad_norm(norm_type: float) -> None:
    model = small_model()
    backward(model)
    ours = grad_norm(model, norm_type)
    theirs = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e12, norm_type=norm_type)
    assert ours.dim() == 0
    assert torch.allclose(ours, theirs, rtol=1e-6)


def test_grad_norm_of_mixed_dtypes_and_no_grads() -> None:
    a = torch.ones(10, requires_grad=True)
    b = torch.ones(4, dtype=torch.float64, requires_grad=True)
    (a.sum() * 3 + (b * 2).sum()).backward()
    assert grad_norm([a, b]).item() == pytest.approx(math.sqrt(10 * 9 + 4 * 4))
    assert grad_norm([torch.zeros(3, requires_grad=True)]).item() == 0.0


def test_fingerprint_agrees_on_replicas_and_catches_one_flipped_bit() -> None:
    a, b = small_model(seed=3), small_model(seed=3)
    assert fingerprint(a).dtype == torch.int64
    assert fingerprint(a).item() == fingerprint(b).item()
    detail = flip_bit(b, bit=3)
    assert "flipped bit 3" in detail
    assert fingerprint(a).item() != fingerprint(b).item()
    flip_bit(b, bit=3)
    assert fingerprint(a).item() == fingerprint(b).item()


def test_fingerprint_handles_half_precision() -> None:
    a = small_model(seed=5).to(torch.bfloat16)
    b = small_model(seed=5).to(torch.bfloat16)
    assert fingerprint(a).item() == fingerprint(b).item()
    flip_bit(b, bit=0)
    assert fingerprint(a).item() != fingerprint(b).item()


def test_nonfinite_checks_and_names() -> None:
    assert nonfinite(float("nan")) is True and nonfinite(1.0) is False
    assert bool(nonfinite(torch.tensor([1.0, float("inf")])))
    model = small_model()
    name = poison_with_nan(model)
    backward(model)
    assert not math.isfinite(grad_norm(model).item())
    bad = nonfinite_grad_names(model)
    assert bad and bad[0] == name
