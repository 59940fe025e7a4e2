"""``bad_batch``: a rank's batch check failed before the forward pass.

The rank names the fault itself (``StepReport.batch_fault``: what, where in the batch,
which sample); this rule gathers one step's faults into one anomaly, which the diagnoser
reads as ``data_pipeline``, not ``numeric``: when the ranks skipped the step by agreement
(``skipped``) the model was never touched, so there is nothing to roll back. Later bad
batches on other ranks widen the open anomaly; it resolves after
``numeric_resolve_steps`` steps without one.
"""

from __future__ import annotations

from trainguard.contract.evidence import BadBatchEvidence

from .job import JobState, StepBucket

KEY = "bad_batch"


class BadBatches:
    """Bad batches of one job."""

    def __init__(self) -> None:
        self.clean_run = 0

    def on_step(self, job: JobState, b: StepBucket, now: float) -> None:
        if not b.batch_faults:
            if job.book.is_open(KEY):
                self.clean_run += 1
                if self.clean_run >= job.th.numeric_resolve_steps:
                    job.book.clear(KEY, now)
            return
        self.clean_run = 0
        ranks = sorted(b.batch_faults)
        shown = ranks[:job.th.evidence_max_ranks]
        job.book.raise_(KEY, "bad_batch", now=now, onset_at=b.first_time, ranks=ranks,
                        hosts=job.hosts_of(ranks), step=b.step,
                        severity="warning" if b.skipped else "critical",
                        evidence=BadBatchEvidence(
                            faults={str(r): b.batch_faults[r] for r in shown},
                            skipped=b.skipped))
