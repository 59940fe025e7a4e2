"""Goodput at scale (model): ETTR of a 16k- and a 100k-GPU synchronous job, per recovery.

A seeded Monte Carlo (``trainguard.analysis.goodput``) of ``--weeks`` of wall time under
Llama 3's published failure mix, scaled linearly with ``--gpus``, for torchrun, NVRx and
trainguard's recovery paths. Every per-fault figure below is a measurement of this
project's (docs/benchmarks.md, the section named beside it) at 4 CPU ranks; what grows at
scale is the explicit restart growth, shown as a sensitivity table. The checkpoint
interval is the coordinator's own rule (``IntervalPolicy().period``, its default bounds)
at the job's MTBF. Runs in about a second: ``make bench`` runs it at its defaults.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from trainguard.analysis.goodput import (
    Fault,
    Path,
    Recovery,
    Result,
    System,
    fault_rates,
    mtbf,
    simulate,
)
from trainguard.services.checkpointer.interval import IntervalPolicy

SAVE_COST_S = 0.26
"""The loop's stall per async DCP save of 1.23 GB of state ("Checkpoints"); a 405B model
with AdamW (~16 B per parameter) holds ~0.4 GB per GPU on 16,384 GPUs, less than that."""
STEP_S = 6 * 405e9 * 128 * 16 * 8192 / (16_384 * 400e12)
"""~6.2 s: one Llama 3 405B step, 6 x parameters x tokens per batch over the GPUs'
throughput, from the paper's Table 4 (16,384 GPUs: DP 128, 16 sequences of 8,192 tokens
per DP rank, 400 TFLOPs/GPU); held at 100k GPUs (weak scaling). Used only for the steps a
memory-snapshot rollback redoes."""
SNAPSHOT_STEPS_LOST = 3
"""Steps redone after a NaN rolled back from memory ("A NaN rolled back from memory")."""
FT_HSDP_SYNC_STALL_S = 600.0
"""Stall per failure recovery of synchronous training at O(100K) GPUs: 10 minutes
(Salpekar et al., "Training LLMs with Fault Tolerant HSDP on 100,000 GPUs", 2026,
abstract; 3 minutes with FT-HSDP). The default restart growth."""
GROWTHS = (0.0, 60.0, 180.0, FT_HSDP_SYNC_STALL_S)

# Measured figures: (detected, back where it was) in seconds at 4 ranks; recovery = back -
# detected. The baselines see a lost host as a hang (its peers wait in a collective until
# the process-group timeout), and never see a silent corruption.
_TORCHRUN_CRASH = (0.8, 10.6)  # "Where a recovery's time goes", fsdp, torchrun
_TORCHRUN_HANG = (11.4, 21.7)  # "Hangs judged in about a second", compute, torchrun
_NVRX_CRASH = (1.1, 13.0)  # "Where a recovery's time goes", fsdp, NVRx 0.4.1
_NVRX_HANG = (6.4, 17.0)  # "Hangs judged in about a second", compute, NVRx 0.4.1
_HSDP_CRASH = (1.4, 3.3)  # "HSDP: a lost shard from its replica", crash, in place
_HSDP_HANG = (5.3, 7.8)  # same, hang, in place
_FSDP_RESTART_CRASH = (1.0, 4.5)  # "Where a recovery's time goes", fsdp, group restart
_FSDP_RESTART_HANG = (5.3, 8.8)  # "Sharded recovery (FSDP2)", hang, group restart
_SNAPSHOT_NAN = (0.2, 0.8)  # "A NaN rolled back from memory", memory snapshots
_DISK_NAN = (0.4, 5.9)  # same, no memory snapshots (the committed checkpoint)
_HOST_DETECT = 4.13  # "A switch lost": loss -> every lost rank named (4,096 ranks)
_HOST_ISOLATED = 6.77 - _HOST_DETECT  # same: -> the lost hosts isolated
_SHRINK_IN_PLACE = 0.42  # "Host isolation": isolate -> world size 2, in place
_SHRINK_RESTART = 17.53  # same, group restart


def _path(measured: tuple[float, float], recovery: Recovery, rework: float = 0.0) -> Path:
    detected, back = measured
    return Path(detected, back - detected, recovery, rework)


def _baseline(name: str, crash: tuple[float, float], hang: tuple[float, float]) -> System:
    restart, hung = _path(crash, Recovery.RESTART), _path(hang, Recovery.RESTART)
    return System(name, {Fault.RANK_LOST: restart, Fault.JOB_CRASH: restart,
                         Fault.HOST_LOST: hung, Fault.HANG: hung,
                         Fault.SDC: Path(0.0, 0.0, Recovery.UNDETECTED)})


def _sharded(name: str, sdc: Path) -> System:
    restart = _path(_FSDP_RESTART_CRASH, Recovery.RESTART)
    return System(name, {
        Fault.RANK_LOST: restart, Fault.JOB_CRASH: restart,
        Fault.HOST_LOST: Path(_HOST_DETECT, _HOST_ISOLATED + _SHRINK_RESTART, Recovery.RESTART),
        Fault.HANG: _path(_FSDP_RESTART_HANG, Recovery.RESTART),
        Fault.SDC: sdc})


def systems() -> list[System]:
    """The baselines and trainguard's three setups, from the measured figures above."""
    rollback = _path(_SNAPSHOT_NAN, Recovery.ROLLBACK, SNAPSHOT_STEPS_LOST * STEP_S)
    replicated = System("trainguard, replicated (HSDP) in place", {
        Fault.RANK_LOST: _path(_HSDP_CRASH, Recovery.IN_PLACE),
        Fault.HOST_LOST: Path(_HOST_DETECT, _HOST_ISOLATED + _SHRINK_IN_PLACE, Recovery.IN_PLACE),
        Fault.JOB_CRASH: _path(_FSDP_RESTART_CRASH, Recovery.RESTART),
        Fault.HANG: _path(_HSDP_HANG, Recovery.IN_PLACE),
        Fault.SDC: rollback})
    return [
        _baseline("torchrun", _TORCHRUN_CRASH, _TORCHRUN_HANG),
        _baseline("NVRx 0.4.1", _NVRX_CRASH, _NVRX_HANG),
        replicated,
        _sharded("trainguard, sharded (FSDP) group restart",
                 _path(_DISK_NAN, Recovery.RESTART)),
        _sharded("trainguard, sharded + memory snapshots", rollback),
    ]


def coordinator_interval(cost: float, mtbf_s: float) -> float:
    """The checkpoint coordinator's Young/Daly period with its default bounds."""
    return IntervalPolicy().period(cost, mtbf_s)[0]


def run(system: System, *, gpus: int, weeks: float, seed: int, runs: int,
        restart_growth: float, reform_growth: float = 0.0) -> list[Result]:
    return [simulate(system, gpus=gpus, seconds=weeks * 7 * 86_400.0, save_cost=SAVE_COST_S,
                     interval=coordinator_interval, seed=seed + i,
                     restart_growth=restart_growth, reform_growth=reform_growth)
            for i in range(runs)]


def _mean_lost(results: list[Result]) -> dict[str, float]:
    """Mean share of wall time per cause, over the runs."""
    return {cause: statistics.fmean(getattr(r.spent, cause) / r.spent.total for r in results)
            for cause in ("checkpoint", "rework", "detection", "recovery")}


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def size_table(gpus: int, weeks: float, seed: int, runs: int, growth: float,
               ) -> tuple[str, dict[str, Any]]:
    rates = fault_rates(gpus)
    m = mtbf(rates)
    rows = ["| system | ETTR (mean, min-max) | checkpoint | rework | detection | recovery |",
            "| --- | --- | --- | --- | --- | --- |"]
    out: dict[str, Any] = {"mtbf_s": m, "interval_s": coordinator_interval(SAVE_COST_S, m),
                           "systems": {}}
    for system in systems():
        results = run(system, gpus=gpus, weeks=weeks, seed=seed, runs=runs,
                      restart_growth=growth)
        ettrs = [r.ettr for r in results]
        lost = _mean_lost(results)
        rows.append(f"| {system.name} | {_pct(statistics.fmean(ettrs))} "
                    f"({_pct(min(ettrs))}-{_pct(max(ettrs))}) | "
                    + " | ".join(_pct(lost[f]) for f in lost) + " |")
        out["systems"][system.name] = {"ettr": statistics.fmean(ettrs), "lost": lost,
                                       "failures": statistics.fmean(r.failures for r in results)}
    head = (f"{gpus:,} GPUs, {weeks:g} weeks, {runs} runs: MTBF {m / 60:.1f} min, "
            f"~{statistics.fmean(v['failures'] for v in out['systems'].values()):.0f} "
            f"failures a run, checkpoint every {out['interval_s']:.0f} s, restart growth "
            f"{growth:g} s")
    return head + "\n\n" + "\n".join(rows), out


def sensitivity(gpus: int, weeks: float, seed: int, runs: int) -> tuple[str, dict[str, Any]]:
    """ETTR against the restart growth; the last column grows the in-place re-forms by the
    same seconds (the worst case for trainguard's in-place paths)."""
    chosen = systems()
    replicated = chosen[2]
    names = [s.name for s in chosen] + [f"{replicated.name}, re-forms grown too"]
    rows = ["| restart growth | " + " | ".join(names) + " |",
            "| --- |" + " --- |" * len(names)]
    out: dict[str, Any] = {}
    for growth in GROWTHS:
        cells = [statistics.fmean(r.ettr for r in run(s, gpus=gpus, weeks=weeks, seed=seed,
                                                      runs=runs, restart_growth=growth))
                 for s in chosen]
        cells.append(statistics.fmean(r.ettr for r in run(
            replicated, gpus=gpus, weeks=weeks, seed=seed, runs=runs,
            restart_growth=growth, reform_growth=growth)))
        rows.append(f"| {growth:g} s | " + " | ".join(_pct(c) for c in cells) + " |")
        out[f"{growth:g}"] = dict(zip(names, cells, strict=True))
    return f"{gpus:,} GPUs: ETTR against the restart growth\n\n" + "\n".join(rows), out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", default="16384,100000", help="job sizes, comma-separated")
    p.add_argument("--weeks", type=float, default=4.0, help="wall time simulated per run")
    p.add_argument("--seed", type=int, default=0, help="the first run's seed")
    p.add_argument("--runs", type=int, default=10, help="seeded runs averaged per cell")
    p.add_argument("--growth", type=float, default=FT_HSDP_SYNC_STALL_S,
                   help="seconds added to every group restart at scale (default: FT-HSDP's "
                        "10 minutes at O(100K) GPUs)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()
    results: dict[str, Any] = {"weeks": args.weeks, "seed": args.seed, "runs": args.runs,
                               "growth_s": args.growth, "sizes": {}}
    for gpus in (int(g) for g in args.gpus.split(",")):
        text, sized = size_table(gpus, args.weeks, args.seed, args.runs, args.growth)
        sens_text, sens = sensitivity(gpus, args.weeks, args.seed, args.runs)
        print(text + "\n\n" + sens_text + "\n", flush=True)
        results["sizes"][str(gpus)] = {**sized, "sensitivity": sens}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
