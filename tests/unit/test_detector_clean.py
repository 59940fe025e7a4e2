"""False positives: a healthy 64-rank job for 10,000 steps must raise nothing.

The stream is as noisy as real training: log-normal compute per rank and step, a
persistent per-rank speed, rare single slow steps (2-3x), a 10 s checkpoint on every rank
every 1,000 steps, fingerprints every 100 steps, a noisy falling loss and grad norm. The
rules run on a simulated clock, so this takes seconds, not hours.
"""

from __future__ import annotations

import time

from trainguard.services.detector.synthetic import Harness, SimConfig
from trainguard.services.detector.thresholds import Thresholds


def test_clean_stream_of_10000_steps_by_64_ranks_raises_nothing() -> None:
    cfg = SimConfig(ranks=64, compute=0.3, jitter=0.1, rank_spread=0.03,
                    slow_step_prob=0.001, checkpoint_every=1000, checkpoint_seconds=(8.0, 12.0),
                    fingerprint_every=100, grad_noise=0.2, seed=2024)
    h = Harness(Thresholds(), cfg, tick_every=0.5)
    started = time.perf_counter()
    h.sim.steps(10_000)
    elapsed = time.perf_counter() - started
    false_positives = h.opened()
    print(f"\nclean stream: {h.sim.messages} messages, 10000 steps x 64 ranks, "
          f"{h.sim.now - cfg.start_time:.0f} s simulated in {elapsed:.1f} s; "
          f"false positives: {len(false_positives)}")
    for a in false_positives:
        print(f"  {a.kind} ranks={a.ranks[:8]} step={a.step} evidence={a.evidence}")
    assert false_positives == []
    progress = h.detector.progress(cfg.job, h.clock)
    assert progress is not None and progress.last_step == 9_999
    assert all(r.state == "ok" for r in progress.ranks.values())
