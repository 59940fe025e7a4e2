"""Gradient health by parameter on a real model: where non-finite gradients started, which
layers carry an exploding norm, and that a normal step examines nothing."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from tests.unit.test_reports import Finished, OnDevice
from trainguard.client.reports import GRAD_SPIKE_WARMUP, Pending, Reports
from trainguard.contract.schemas import StepReport
from trainguard.torch.stats import (
    grad_norm,
    largest_grad_norms,
    nonfinite_grad_origin,
    poison_with_nan,
)


class Net(nn.Module):
    """Four linear layers, registered in the order they run."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def nan_in_backward_of(layer: nn.Module) -> None:
    """The gradient of ``layer``'s output turns NaN: born in backward, at that layer."""
    def hook(_m: nn.Module, _i: Any, out: torch.Tensor) -> None:
        out.register_hook(lambda g: torch.full_like(g, math.nan))

    layer.register_forward_hook(hook)


def backward(model: nn.Module) -> None:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    model(torch.randn(8, 16)).pow(2).mean().backward()


def reports_for(model: nn.Module, **kw: Any) -> tuple[Reports, list[StepReport]]:
    out: list[StepReport] = []
    reports = Reports("j", 2, 0, report_every=1, fingerprint_every=0, model=lambda: model,
                      publish_step=out.append, publish_fingerprint=lambda _f: None, **kw)
    return reports, out


def train_step(reports: Reports, out: list[StepReport], model: nn.Module, n: int, *,
               scale: dict[str, float] | None = None) -> StepReport:
    """One step of ``model`` (gradients of ``scale``'s parameters multiplied), reported."""
    backward(model)
    for name, p in model.named_parameters():
        if scale and name in scale and p.grad is not None:
            p.grad.mul_(scale[name])
    reports.record(Finished(n, loss=1.0, grad_norm=grad_norm(model)), 0.1)
    return out[-1]


def test_a_nan_born_in_backward_names_that_layer_not_the_embedding_end() -> None:
    model = Net()
    nan_in_backward_of(model.layers[2])
    backward(model)
    origin = nonfinite_grad_origin(model)
    assert origin.names[0] == "layers.2.weight" and origin.basis == "backward"
    # layers 2, 1 and 0 (weight and bias each) went bad; layer 3, reached first, did not.
    assert (origin.count, origin.total) == (6, 8)
    assert origin.names[:4] == ["layers.2.weight", "layers.2.bias", "layers.1.weight",
                                "layers.1.bias"]


def test_a_nan_in_the_forward_pass_spoils_every_gradient_and_says_so() -> None:
    model = Net()
    model.layers[1].register_forward_hook(lambda _m, _i, out: out * math.nan)
    backward(model)
    origin = nonfinite_grad_origin(model)
    assert origin.basis == "forward" and origin.count == origin.total == 8
    assert origin.names[0] == "layers.3.weight", "backward reached it first"


def test_a_parameter_that_holds_nan_is_named_itself() -> None:
    model = Net()
    poison_with_nan(model)
    backward(model)
    origin = nonfinite_grad_origin(model)
    assert origin.basis == "parameter" and origin.names == ["layers.0.weight"]
    assert origin.count == 8


def test_finite_gradients_name_nothing() -> None:
    model = Net()
    backward(model)
    assert nonfinite_grad_origin(model).names == []
    assert nonfinite_grad_origin(Net()).total == 0, "no gradients yet"


def test_largest_grad_norms_rank_the_parameters() -> None:
    model = Net()
    backward(model)
    model.layers[1].weight.grad.mul_(1e4)  # type: ignore[union-attr]
    top = largest_grad_norms(model, top=3)
    assert next(iter(top)) == "layers.1.weight" and len(top) == 3
    norms = list(top.values())
    assert norms == sorted(norms, reverse=True)
    assert norms[0] == pytest.approx(float(model.layers[1].weight.grad.norm()), rel=1e-5)  # type: ignore[union-attr]


def test_a_step_with_a_nan_born_in_backward_reports_where_it_started() -> None:
    model = Net()
    reports, out = reports_for(model)
    for n in range(3):
        train_step(reports, out, model, n)
    nan_in_backward_of(model.layers[2])
    bad = train_step(reports, out, model, 3)
    assert math.isnan(bad.grad_norm or 0.0) and bad.nonfinite == 1
    assert bad.nonfinite_params[0] == "layers.2.weight"
    assert (bad.nonfinite_count, bad.nonfinite_basis) == (6, "backward")
    assert reports.grad_examinations == 1
    assert [r.nonfinite_params for r in out[:3]] == [[], [], []]


def test_an_exploding_step_names_the_layer_whose_gradient_exploded() -> None:
    model = Net()
    reports, out = reports_for(model)
    for n in range(GRAD_SPIKE_WARMUP + 4):
        train_step(reports, out, model, n)
    assert reports.grad_examinations == 0, "normal steps examine no parameter"
    assert all(not r.spike_params and r.nonfinite_count == 0 for r in out)
    spike = train_step(reports, out, model, 99, scale={"layers.1.weight": 1e4})
    assert next(iter(spike.spike_params)) == "layers.1.weight"
    assert len(spike.spike_params) == 3
    assert reports.grad_examinations == 1
    after = train_step(reports, out, model, 100)
    assert not after.spike_params and reports.grad_examinations == 1


def test_no_spike_is_judged_before_the_warm_up_or_when_turned_off() -> None:
    model = Net()
    reports, out = reports_for(model, grad_spike_factor=0)
    for n in range(GRAD_SPIKE_WARMUP + 2):
        train_step(reports, out, model, n)
    assert not train_step(reports, out, model, 50, scale={"layers.0.weight": 1e6}).spike_params
    fresh, fresh_out = reports_for(model)
    assert not train_step(fresh, fresh_out, model, 0, scale={"layers.0.weight": 1e6}).spike_params
    assert reports.grad_examinations == fresh.grad_examinations == 0
    with pytest.raises(ValueError, match="grad_spike_factor"):
        reports_for(model, grad_spike_factor=-1.0)


def test_a_norm_judged_after_the_gradients_moved_on_names_nothing() -> None:
    """A device value finished a step late: the gradients then are another step's."""
    model = Net()
    reports, out = reports_for(model)
    nan_in_backward_of(model.layers[2])
    backward(model)
    reports.record(Finished(0, loss=1.0), 0.1)
    late = OnDevice(math.nan)
    reports.pending.append(Pending(StepReport(job="j", time=0.0, rank=2, step=0, loss=1.0),
                                   {"grad_norm": late}))
    reports.record(Finished(1, loss=1.0), 0.1)  # step 1's gradients are in place now
    late.done = True
    reports.poll(force=False)
    [bad] = [r for r in out if r.nonfinite]
    assert bad.step == 0 and bad.nonfinite_params == [] and reports.grad_examinations == 0
