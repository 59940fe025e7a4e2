"""Bad numerics and silent data corruption.

* ``nonfinite``: NaN/Inf in a loss or grad norm (or non-finite parameters counted by the
  client), at the step it happens. When only a minority of the ranks that reported the
  step see it, the value went bad on those ranks before the all-reduce: the evidence
  says so (``minority``, ``sdc_hint``) because that points at their hardware. Where the
  ranks named the parameters whose gradients went non-finite (``StepReport.
  nonfinite_params``, origin first), the evidence carries them per rank and the lowest
  such rank's origin as ``first_param``.
* ``grad_explosion`` / ``grad_vanishing`` / ``loss_spike``: the step's value (median
  across ranks) against the job's own rolling baseline, in log space for grad norms
  (they vary by orders of magnitude), after ``numeric_warmup`` steps of baseline. The
  baseline keeps learning, so a lasting regime change becomes normal. It starts over when
  the job is re-formed or retuned, as the Guard reports it: a new attempt (a restart,
  resume or rollback), another world size, another learning rate, a rank's new process
  (its hello). A job that shrank from 4 ranks to 2 has another loss curve; judged against
  the old one it would look "numeric" and be rolled back for nothing. An explosion
  carries the parameters with the largest gradients of the rank with the largest norm
  among those whose own norm spiked (``StepReport.spike_params``).
* ``sdc_mismatch``: replicas of one group disagree on the parameter checksum at the same
  step. Its step is the first one the corruption may have reached (after the group's
  last agreeing round; ``found_step`` is where it showed). A group is the ranks that hold
  the same state (the client names it: the whole job
  under plain data parallelism, one shard's replicas under HSDP; a job whose state has no
  replicas sends none). The minority ranks are the suspects; a tie names no one and says
  so.

Each anomaly resolves after ``numeric_resolve_steps`` normal steps (fingerprints: at the
next round that agrees).
"""

from __future__ import annotations

import math
from collections import Counter

from trainguard.contract.evidence import (
    GradExplosionEvidence,
    GradVanishingEvidence,
    LossSpikeEvidence,
    NonfiniteEvidence,
    SdcMismatchEvidence,
)
from trainguard.contract.schemas import AnomalyKind, Fingerprint

from .job import JobState, StepBucket
from .windows import ROBUST_SIGMA, Ring, median

LOG_SIGMA_FLOOR = 0.05
"""Smallest robust sigma of log(grad norm): a 5% wobble, for unnaturally steady norms."""


class Numerics:
    """Non-finite values, gradient explosion and vanishing, and loss spikes of one job."""

    def __init__(self, job: JobState) -> None:
        th = job.th
        self.log_grads = Ring(th.numeric_window)
        self.losses = Ring(th.numeric_window)
        self.normal_run: dict[str, int] = {}
        self.vanishing_run = 0
        self.regime: tuple[int, int, float | None] | None = None
        """(incarnation, world size, learning rate) the baselines were learned under."""
        self.restarts = 0
        """How often the baselines started over (for tests and the log)."""

    def restart(self) -> None:
        """Forget the loss and gradient baselines: the job runs under new conditions."""
        if len(self.log_grads) or len(self.losses):
            self.restarts += 1
        self.log_grads.clear()
        self.losses.clear()
        self.vanishing_run = 0

    def _regime(self, job: JobState, b: StepBucket) -> None:
        regime = (job.incarnation, b.world or job.world_size, b.lr)
        if regime != self.regime:
            if self.regime is not None:
                self.restart()
            self.regime = regime

    def _normal(self, job: JobState, key: str, now: float) -> None:
        if job.book.is_open(key):
            run = self.normal_run.get(key, 0) + 1
            self.normal_run[key] = run
            if run >= job.th.numeric_resolve_steps:
                self.normal_run.pop(key, None)
                job.book.clear(key, now)

    def _abnormal(self, key: str) -> None:
        self.normal_run[key] = 0

    def on_step(self, job: JobState, b: StepBucket, now: float) -> None:
        self._regime(job, b)
        if b.nonfinite:
            self._nonfinite(job, b, now)
            return
        self._normal(job, "nonfinite", now)
        grads = [g for g in b.grads.values() if g > 0.0]
        losses = list(b.losses.values())
        if grads:
            self._grads(job, b, median(grads), now)
        elif b.grads:
            self._grads(job, b, 0.0, now)
        if losses:
            self._loss(job, b, median(losses), now)

    def _nonfinite(self, job: JobState, b: StepBucket, now: float) -> None:
        self._abnormal("nonfinite")
        bad = sorted(set(b.nonfinite))
        minority = len(bad) * 2 < b.count
        cap = job.th.evidence_max_ranks
        evidence = NonfiniteEvidence(
            nonfinite_ranks=bad[:cap], ranks_reporting=b.count, minority=minority,
            sdc_hint=minority,
            loss={str(r): b.losses[r] for r in bad[:cap] if r in b.losses},
            grad_norm={str(r): b.grads[r] for r in bad[:cap] if r in b.grads},
            bad_batch_ranks=sorted(r for r, f in b.batch_faults.items()
                                   if f.kind == "nonfinite")[:cap])
        named = sorted(b.grad_origins)
        if named:
            first = b.grad_origins[named[0]]
            evidence.first_param = first.nonfinite_params[0]
            evidence.first_rank = named[0]
            evidence.param_basis = first.nonfinite_basis
            evidence.params_affected = first.nonfinite_count
            evidence.params = {str(r): b.grad_origins[r].nonfinite_params for r in named[:cap]}
        job.book.raise_("nonfinite", "nonfinite", now=now, onset_at=b.first_time, ranks=bad,
                        hosts=job.hosts_of(bad), step=b.step, severity="critical",
                        evidence=evidence)

    def _grads(self, job: JobState, b: StepBucket, g: float, now: float) -> None:
        th = job.th
        base = self.log_grads.median_mad() if len(self.log_grads) >= th.numeric_warmup else None
        if g > 0.0:
            self.log_grads.add(math.log(g))
        if base is None:
            return
        med, mad = base
        sigma = max(ROBUST_SIGMA * mad, LOG_SIGMA_FLOOR)
        usual = math.exp(med)
        z = (math.log(g) - med) / sigma if g > 0.0 else float("-inf")
        shown_z = round(z, 2) if g > 0.0 else z
        window = len(self.log_grads)
        if z > th.grad_z and g > usual * th.grad_explosion_ratio:
            self._abnormal("grad_explosion")
            top = max(b.spikes, key=lambda r: b.grads.get(r, 0.0)) if b.spikes else None
            self._raise(job, b, "grad_explosion", now, GradExplosionEvidence(
                grad_norm=g, baseline_median=usual, z=shown_z, grad_z=th.grad_z, window=window,
                grad_explosion_ratio=th.grad_explosion_ratio, top_rank=top,
                top_params=b.spikes[top] if top is not None else {}),
                self._outliers(b.grads, usual * th.grad_explosion_ratio, above=True))
        else:
            self._normal(job, "grad_explosion", now)
        if z < -th.grad_z and g < usual / th.grad_vanishing_ratio:
            self.vanishing_run += 1
            self._abnormal("grad_vanishing")
            if self.vanishing_run >= th.grad_vanishing_steps:
                self._raise(job, b, "grad_vanishing", now, GradVanishingEvidence(
                    grad_norm=g, baseline_median=usual, z=shown_z, grad_z=th.grad_z,
                    window=window, grad_vanishing_ratio=th.grad_vanishing_ratio,
                    steps=self.vanishing_run),
                    self._outliers(b.grads, usual / th.grad_vanishing_ratio, above=False))
        else:
            self.vanishing_run = 0
            self._normal(job, "grad_vanishing", now)

    def _loss(self, job: JobState, b: StepBucket, loss: float, now: float) -> None:
        th = job.th
        base = self.losses.median_mad() if len(self.losses) >= th.numeric_warmup else None
        self.losses.add(loss)
        if base is None:
            return
        med, mad = base
        sigma = max(ROBUST_SIGMA * mad, 1e-12)
        margin = max(th.loss_z * sigma, th.loss_spike_rel * abs(med))
        if loss - med > margin:
            self._abnormal("loss_spike")
            self._raise(job, b, "loss_spike", now, LossSpikeEvidence(
                loss=loss, baseline_median=med, mad=mad, z=round((loss - med) / sigma, 2),
                loss_z=th.loss_z, loss_spike_rel=th.loss_spike_rel, window=len(self.losses)),
                self._outliers(b.losses, med + margin, above=True))
        else:
            self._normal(job, "loss_spike", now)

    @staticmethod
    def _outliers(values: dict[int, float], bound: float, *, above: bool) -> list[int]:
        return sorted(r for r, v in values.items() if (v > bound if above else v < bound))

    def _raise(self, job: JobState, b: StepBucket, kind: AnomalyKind, now: float,
               evidence: GradExplosionEvidence | GradVanishingEvidence | LossSpikeEvidence,
               ranks: list[int]) -> None:
        named = ranks or [r for r in b.compute]
        job.book.raise_(kind, kind, now=now, onset_at=b.first_time, ranks=named,
                        hosts=job.hosts_of(named), step=b.step, evidence=evidence)


class _Round:
    __slots__ = ("checksums", "first_time", "step")

    def __init__(self, step: int, first_time: float) -> None:
        self.step = step
        self.first_time = first_time
        self.checksums: dict[int, int] = {}


class Fingerprints:
    """Parameter checksums of each data-parallel group, compared step by step."""

    def __init__(self) -> None:
        self.attempt = 0
        self.rounds: dict[tuple[str, int], _Round] = {}
        self.members: dict[str, int] = {}
        """Size of each group, learned from its last complete round."""
        self.agreed: dict[str, int] = {}
        """The newest step at which each group's replicas agreed."""

    def on_fingerprint(self, job: JobState, fp: Fingerprint, now: float) -> None:
        key = (fp.group, fp.step)
        rnd = self.rounds.get(key)
        if rnd is None:
            # A newer round of the group means older ones are as complete as they get.
            for old in [k for k in self.rounds if k[0] == fp.group and k[1] < fp.step]:
                self._judge(job, fp.group, self.rounds.pop(old), now)
            rnd = self.rounds[key] = _Round(fp.step, fp.time)
        rnd.checksums[fp.rank] = fp.checksum
        # A sharded job's group is a shard's replicas, not the job (older clients: the job).
        size = fp.group_size if fp.group_size >= 2 else self.members.get(fp.group, job.expected)
        if len(rnd.checksums) >= size:
            self._judge(job, fp.group, self.rounds.pop(key), now)

    def tick(self, job: JobState, now: float) -> None:
        for key in [k for k, r in self.rounds.items() if now - r.first_time > job.th.fp_wait]:
            self._judge(job, key[0], self.rounds.pop(key), now)

    def reset(self, attempt: int) -> None:
        """A new attempt: steps start over, so rounds of the old one mean nothing now."""
        self.attempt = attempt
        self.rounds.clear()
        self.agreed.clear()

    def _judge(self, job: JobState, group: str, rnd: _Round, now: float) -> None:
        sums = rnd.checksums
        if len(sums) < 2:
            return
        self.members[group] = max(self.members.get(group, 0), len(sums))
        key = f"sdc:{group}"
        votes = Counter(sums.values())
        if len(votes) == 1:
            self.agreed[group] = max(rnd.step, self.agreed.get(group, rnd.step))
            job.book.clear(key, now, agreed_step=rnd.step)
            return
        ranked = votes.most_common()
        tie = ranked[0][1] == ranked[1][1]
        majority = None if tie else ranked[0][0]
        suspects = [] if tie else sorted(r for r, c in sums.items() if c != majority)
        named = suspects or sorted(sums)
        cap = job.th.evidence_max_ranks
        # The corruption may be anywhere after the last round that agreed: the anomaly's
        # step is the first one it may have reached, so a rollback below it never restores
        # a state (a memory snapshot, a checkpoint) taken after the fault and before it
        # showed. Without an agreed round: the step it was found at.
        agreed = self.agreed.get(group)
        since = agreed + 1 if agreed is not None and agreed < rnd.step else rnd.step
        job.book.raise_(key, "sdc_mismatch", now=now, onset_at=rnd.first_time, ranks=named,
                        hosts=job.hosts_of(named), step=since, severity="critical",
                        evidence=SdcMismatchEvidence(
                            group=group, tie=tie, suspects=suspects, majority_checksum=majority,
                            votes={str(c): n for c, n in ranked[:16]},
                            checksums={str(r): c for r, c in sorted(sums.items())[:cap]},
                            ranks_reporting=len(sums), found_step=rnd.step,
                            agreed_step=agreed))
