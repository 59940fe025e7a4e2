"""What finished steps become: step reports and parameter fingerprints.

No transport here: finished messages go to the two ``publish_*`` callables the Guard
passes (tests pass lists' ``append``). Values that are device tensors are not read at once
(that would wait for the GPU): the message waits in ``pending`` until every value is ready,
checked at later steps without blocking, and goes out then (the value of step N may be
published during step N+1). With ``report_every > 1`` reports are averaged over that many
steps, except that a non-finite value goes out at once.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from trainguard.contract.evidence import BatchFault
from trainguard.contract.schemas import Fingerprint, StepReport

from .values import Deferred, is_tensor, read_number

log = logging.getLogger("trainguard.client")

PENDING_LIMIT = 64
"""Messages waiting for a device far behind: beyond this the oldest are dropped."""

GRAD_SPIKE_FACTOR = 10.0
"""A step's gradient norm above this many times the median of the recent finite ones is a
spike: the step's report names the parameters with the largest gradients."""
GRAD_SPIKE_WINDOW = 50
"""Recent finite gradient norms the median is taken over."""
GRAD_SPIKE_WARMUP = 8
"""Finite norms seen before any step is judged a spike."""
GRAD_SPIKE_TOP = 3
"""Parameters a spike's report names."""


class FinishedStep(Protocol):
    """What :class:`~.steps.Step` holds when it ends."""

    n: int
    phases: dict[str, float]
    loss: Any
    grad_norm: Any
    tokens: int | None
    samples: int | None
    extra: dict[str, Any] | None
    lr: float | None
    batch_fault: BatchFault | None
    skipped: bool


class Pending:
    """A message whose ``deferred`` values (by field name; ``extra.<k>`` for extras) are
    still on the device."""

    __slots__ = ("deferred", "message")

    def __init__(self, message: StepReport | Fingerprint, deferred: dict[str, Deferred]):
        self.message = message
        self.deferred = deferred


def read_value(name: str, raw: Any, deferred: dict[str, Deferred]) -> float | None:
    """A float now, or None with the value parked in ``deferred`` under ``name``."""
    if raw is None:
        return None
    value = read_number(raw)
    if value is None or isinstance(value, float):
        return value
    deferred[name] = value
    return None


def aggregate(reports: list[StepReport]) -> StepReport:
    """One report for several steps: the last one's step, loss and time; mean duration and
    phases; the largest grad norm (a non-finite one wins) and the parameters a spike named;
    summed counts."""
    last = reports[-1]
    phases: dict[str, float] = {}
    for r in reports:
        for k, v in r.phases.items():
            phases[k] = phases.get(k, 0.0) + v / len(reports)
    norms = [r.grad_norm for r in reports if r.grad_norm is not None]
    last.duration = sum(r.duration for r in reports) / len(reports)
    last.phases = phases
    last.grad_norm = max(norms, key=lambda v: v if math.isfinite(v) else math.inf) \
        if norms else None
    last.nonfinite = sum(r.nonfinite for r in reports)
    if not last.spike_params:  # the largest finite norm's, if a spike named parameters
        spiked = [r for r in reports if r.spike_params and r.grad_norm is not None]
        if spiked and last.grad_norm is not None and math.isfinite(last.grad_norm):
            last.spike_params = max(spiked, key=lambda r: r.grad_norm or 0.0).spike_params
    last.tokens = sum(r.tokens or 0 for r in reports) or None
    last.samples = sum(r.samples or 0 for r in reports) or None
    last.steps = len(reports)
    if last.batch_fault is None:
        last.batch_fault = next((r.batch_fault for r in reports if r.batch_fault), None)
    last.skipped = any(r.skipped for r in reports)
    return last



class Reports:
    """Builds this rank's step reports and fingerprints and hands them on when complete.

    Args:
        job, rank, attempt: the rank's identity (``attempt`` = torchrun's restart count).
        world_size: the job's size as this rank started it (0: unknown).
        lr: the optimizer's current learning rate, or None (read once per step).
        report_every: one report per this many steps (aggregated).
        fingerprint_every: steps between fingerprints (0: never); needs a model.
        model: returns the attached model, or None.
        publish_step, publish_fingerprint: where finished messages go.
        grad_spike_factor: a gradient norm above this many times the median of the recent
            finite ones names the largest parameter gradients (0: never).

    Gradient evidence by parameter is computed only for a step that needs it, never on a
    normal one: a non-finite gradient norm names where the non-finite gradients started
    (``nonfinite_params``, ``nonfinite_count``, ``nonfinite_basis``; see
    :func:`trainguard.torch.stats.nonfinite_grad_origin`), a spike names the parameters
    with the largest gradient norms (``spike_params``). Both read the model's gradients
    when the step's report is finished, so they need them still in place: a norm the
    device had not finished by the end of its step is judged later, when the gradients
    may belong to another step, and then names nothing (``grad_examinations`` counts the
    steps that did look).
    """

    def __init__(self, job: str, rank: int, attempt: int, *, report_every: int,
                 fingerprint_every: int, model: Callable[[], Any],
                 publish_step: Callable[[StepReport], None],
                 publish_fingerprint: Callable[[Fingerprint], None], world_size: int = 0,
                 lr: Callable[[], float | None] = lambda: None,
                 grad_spike_factor: float = GRAD_SPIKE_FACTOR) -> None:
        if report_every < 1:
            raise ValueError(f"report_every={report_every}: must be at least 1")
        if grad_spike_factor < 0 or not math.isfinite(grad_spike_factor):
            raise ValueError(f"grad_spike_factor={grad_spike_factor}: must be 0 (off) or "
                             "a positive number")
        self.grad_spike_factor = grad_spike_factor
        self.norms: deque[float] = deque(maxlen=GRAD_SPIKE_WINDOW)
        """The recent finite gradient norms (the spike baseline)."""
        self._baseline: float | None = None
        """Their median, taken again every ``GRAD_SPIKE_WARMUP`` norms: a step pays a
        comparison, not a sort."""
        self.grad_examinations = 0
        """Steps whose gradients were examined parameter by parameter (bad steps only)."""
        self._grads_step: int | None = None
        """The step whose gradients the model holds now (the last one recorded)."""
        self.job, self.rank, self.attempt = job, rank, attempt
        self.report_every = report_every
        self.fingerprint_every = fingerprint_every
        self.model = model
        self.publish_step = publish_step
        self.publish_fingerprint = publish_fingerprint
        self.world_size = world_size
        self.lr = lr
        self.seq = 0
        self.pending: list[Pending] = []
        self.aggregated: list[StepReport] = []
        self.nonfinite_at: int | None = None
        """The first step this rank reported a non-finite loss or gradient norm, since its
        state was last restored (:meth:`Guard.rewind` clears it)."""
        self.last_finished: tuple[int, bool] = (-1, False)
        """The step of the newest report finished, and whether it went non-finite."""
        self._replicas: tuple[int, tuple[str, int] | None] | None = None
        """(id of the last fingerprinted model, its replica group and size, or None where no
        other rank holds this rank's state)."""

    def record(self, step: FinishedStep, duration: float, *, nan_loss: bool = False) -> bool:
        """Report ``step``; ``nan_loss`` (the ``nan`` drill) reports its loss as NaN.
        Returns whether it did (a loss still on the device cannot be replaced yet)."""
        self.seq += 1
        self._grads_step = step.n
        deferred: dict[str, Deferred] = {}
        loss = read_value("loss", step.loss, deferred)
        grad_norm = read_value("grad_norm", step.grad_norm, deferred)
        poisoned = nan_loss and loss is not None
        if poisoned:
            loss = math.nan
        extra: dict[str, float] = {}
        if step.extra:
            for k, v in step.extra.items():
                val = read_value(f"extra.{k}", v, deferred)
                if val is not None:
                    extra[k] = val
        report = StepReport(job=self.job, time=time.time(), seq=self.seq, rank=self.rank,
                            step=step.n, attempt=self.attempt, duration=duration,
                            phases=step.phases, loss=loss, grad_norm=grad_norm,
                            tokens=step.tokens, samples=step.samples, extra=extra,
                            world_size=self.world_size,
                            lr=step.lr if step.lr is not None else self.lr(),
                            batch_fault=step.batch_fault, skipped=step.skipped)
        if deferred:
            self.pending.append(Pending(report, deferred))
        else:
            self._finish(report)
        model = self.model()
        if self.fingerprint_every and model is not None and step.n % self.fingerprint_every == 0:
            self._fingerprint(step.n, model)
        if self.pending:
            self.poll(force=False)
        return poisoned

    def poll(self, *, force: bool) -> None:
        """Send what the device has finished (everything, read now, with ``force``)."""
        still: list[Pending] = []
        waiting: set[int] = set()
        """Steps whose report is still on the device: their fingerprints wait behind it."""
        for p in self.pending:
            msg = p.message
            if not (force or all(d.ready() for d in p.deferred.values())) \
                    or (isinstance(msg, Fingerprint) and msg.step in waiting):
                if isinstance(msg, StepReport):
                    waiting.add(msg.step)
                still.append(p)
                continue
            for name, d in p.deferred.items():
                value = d.value()
                if isinstance(msg, Fingerprint):
                    msg.checksum = int(value)
                elif name.startswith("extra."):
                    msg.extra[name[6:]] = value
                else:
                    setattr(msg, name, value)
            if isinstance(msg, StepReport):
                self._finish(msg)
            else:
                self._send_fingerprint(msg)
        self.pending = still[-PENDING_LIMIT:]

    def flush(self) -> None:
        """Send the reports aggregated so far (at close, or on a non-finite value)."""
        reports, self.aggregated = self.aggregated, []
        if reports:
            self.publish_step(aggregate(reports))

    def _finish(self, report: StepReport) -> None:
        """Non-finite evidence, then publish (or aggregate for ``report_every``)."""
        bad = sum(1 for v in (report.loss, report.grad_norm)
                  if v is not None and not math.isfinite(v))
        if bad:
            report.nonfinite = bad
            if self.nonfinite_at is None:
                self.nonfinite_at = report.step
        self.last_finished = (report.step, bool(bad))
        norm = report.grad_norm
        if norm is not None:
            if not math.isfinite(norm):
                self._name_nonfinite(report)
            else:
                if self._spike(norm):
                    self._name_spike(report)
                self.norms.append(norm)
                if len(self.norms) % GRAD_SPIKE_WARMUP == 0:
                    self._baseline = statistics.median(self.norms)
        if self.report_every == 1:
            self.publish_step(report)
            return
        self.aggregated.append(report)
        if len(self.aggregated) >= self.report_every or bad or report.batch_fault:
            self.flush()

    def _spike(self, norm: float) -> bool:
        """``norm`` is above ``grad_spike_factor`` times the recent finite norms' median."""
        return bool(self.grad_spike_factor) and self._baseline is not None \
            and norm > self.grad_spike_factor * self._baseline

    def _model_with_grads_of(self, report: StepReport) -> Any:
        """The model, if its gradients are still the ones of ``report``'s step."""
        if report.step != self._grads_step:
            return None
        return self.model()

    def _name_nonfinite(self, report: StepReport) -> None:
        model = self._model_with_grads_of(report)
        if model is None:
            return
        from trainguard.torch.stats import nonfinite_grad_origin

        self.grad_examinations += 1
        try:
            origin = nonfinite_grad_origin(model)
        except Exception:  # evidence only: the report goes out without it
            log.debug("naming non-finite gradients failed", exc_info=True)
            return
        report.nonfinite_params = origin.names
        report.nonfinite_count = origin.count
        report.nonfinite_basis = origin.basis

    def _name_spike(self, report: StepReport) -> None:
        model = self._model_with_grads_of(report)
        if model is None:
            return
        from trainguard.torch.stats import largest_grad_norms

        self.grad_examinations += 1
        try:
            report.spike_params = largest_grad_norms(model, GRAD_SPIKE_TOP)
        except Exception:  # evidence only: the report goes out without it
            log.debug("naming the largest gradients failed", exc_info=True)

    def _replica_group(self, model: Any) -> tuple[str, int] | None:
        """This rank's replica group and its size, read once per model (None: no other
        rank holds this rank's state, so there is nothing to compare it with)."""
        if self._replicas is None or self._replicas[0] != id(model):
            from trainguard.torch.stats import state_layout

            layout = state_layout(model)
            comparable = layout.topology.kind != "sharded"
            if not comparable:
                log.warning(
                    "trainguard: parameter fingerprints off: no two ranks hold the same "
                    "state (%s), so there is nothing to compare across ranks; silent data "
                    "corruption then shows only in numerics (NaN, spikes) or needs "
                    "redundant computation", layout.topology.describe())
            self._replicas = (id(model),
                              (layout.group, layout.group_size) if comparable else None)
        return self._replicas[1]

    def _fingerprint(self, n: int, model: Any) -> None:
        from trainguard.torch.stats import fingerprint

        replicas = self._replica_group(model)
        if replicas is None:
            return
        group, size = replicas
        value = fingerprint(model)
        fp = Fingerprint(job=self.job, time=time.time(), seq=self.seq, rank=self.rank, step=n,
                         checksum=0, attempt=self.attempt, group=group, group_size=size)
        if is_tensor(value) and value.device.type != "cpu":
            from trainguard.torch.values import defer_tensor

            self.pending.append(Pending(fp, {"checksum": defer_tensor(value)}))
            return
        fp.checksum = int(value.item() if is_tensor(value) else value)
        if self.pending:  # its step's report still waits on the device: it goes first
            self.pending.append(Pending(fp, {}))
        else:
            self._send_fingerprint(fp)

    def _send_fingerprint(self, fp: Fingerprint) -> None:
        """Publish ``fp`` unless its step went non-finite here: NaN bit patterns differ from
        rank to rank (a NaN written is not the NaN an operation makes), so replicas that all
        went NaN would disagree, and the non-finite report is the evidence already. A step
        report goes out before its step's fingerprint (both queue in order), so this knows."""
        if self.last_finished == (fp.step, True):
            log.debug("no fingerprint for step %d: it went non-finite", fp.step)
            return
        self.publish_fingerprint(fp)
