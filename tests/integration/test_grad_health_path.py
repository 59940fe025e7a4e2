"""Gradient health by parameter, from a real model's bad step to the diagnosis: the ranks'
reports (built by the client's ``Reports`` from a torch model whose backward turned NaN in
one layer) go through real nats-server to the detector, whose anomaly the diagnoser (on
the same servers) turns into a diagnosis naming that layer."""

from __future__ import annotations

import math
import time
from typing import Any

import msgspec
import torch
from torch import nn

from tests.integration.diagnoses import diagnoser_settings, diagnoses
from tests.integration.recorder import running
from tests.integration.test_detector_service import detecting, of, settings, until
from trainguard.client.reports import Reports
from trainguard.contract.schemas import StepReport
from trainguard.services.detector.service import DetectorService
from trainguard.services.diagnoser.service import DiagnoserService
from trainguard.torch.stats import grad_norm


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class _Finished:
    def __init__(self, n: int, norm: torch.Tensor) -> None:
        self.n, self.loss, self.grad_norm = n, 1.0, norm
        self.tokens = self.samples = self.extra = self.lr = self.batch_fault = None
        self.skipped = False
        self.phases: dict[str, float] = {"compute": 0.04}


def bad_step_report(step: int) -> StepReport:
    """What a rank's client reports for a step whose backward turned NaN in layers.2."""
    model = Net()

    def hook(_m: nn.Module, _i: Any, out: torch.Tensor) -> None:
        out.register_hook(lambda g: torch.full_like(g, math.nan))

    model.layers[2].register_forward_hook(hook)
    model(torch.randn(4, 8)).sum().backward()
    out: list[StepReport] = []
    reports = Reports("j", 0, 0, report_every=1, fingerprint_every=0, model=lambda: model,
                      publish_step=out.append, publish_fingerprint=lambda _f: None)
    reports.record(_Finished(step, grad_norm(model)), 0.05)  # type: ignore[arg-type]
    return out[0]


async def test_a_nan_born_in_one_layer_is_named_in_the_anomaly_and_the_diagnosis(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any) -> None:
    got = await diagnoses(nc, settings(nats_url, redis_url, prefix).subjects, job)
    detector = DetectorService(settings(nats_url, redis_url, prefix))
    diagnoser = DiagnoserService(diagnoser_settings(nats_url, redis_url, prefix))
    template = bad_step_report(0)
    assert template.nonfinite_params[0] == "layers.2.weight"
    async with running(diagnoser), detecting(detector, nc, job) as (ranks, seen):
        await ranks.steps(5)
        step = ranks.step
        for r in ranks.ranks:
            ranks.seq += 1
            await ranks.bus.publish_telemetry(ranks.s.step(job, r), msgspec.structs.replace(
                template, job=job, rank=r, step=step, seq=ranks.seq, time=time.time()))
        ranks.step += 1
        await ranks.steps(2)
        await until(lambda: of(seen, "nonfinite"), what="a nonfinite anomaly")
        await until(lambda: got, what="its diagnosis")
    [bad] = of(seen, "nonfinite")
    assert bad.step == step and bad.evidence.first_param == "layers.2.weight"
    assert bad.evidence.first_rank == 0 and bad.evidence.param_basis == "backward"
    assert bad.evidence.params_affected == 6 and set(bad.evidence.params) == {"0", "1", "2", "3"}
    diag = got[0]
    assert diag.cause == "numeric"
    fact = f"gradients went non-finite first in layers.2.weight on rank 0 at step {step}"
    assert any(e.fact.startswith(fact) for e in diag.evidence)
    assert fact in diag.summary
