"""When a GPU reading cannot wait for the next regular sample (:func:`gpu.alarm`)."""

from __future__ import annotations

import msgspec

from trainguard.agent.gpu import alarm
from trainguard.contract.schemas import GpuStats, XidEvent

HEALTHY = [GpuStats(index=i, ecc_uncorrected_volatile=0, ecc_uncorrected_aggregate=3,
                    remapped_rows_pending=False) for i in range(2)]


def changed(index: int, **fields: object) -> list[GpuStats]:
    return [msgspec.structs.replace(g, **fields) if g.index == index else g for g in HEALTHY]


def test_a_quiet_reading_waits_for_the_regular_sample() -> None:
    assert alarm(HEALTHY, HEALTHY, []) == ""
    assert alarm(None, HEALTHY, []) == ""  # nothing sent yet: the first sample goes anyway
    cooler = changed(1, temperature_c=40.0, ecc_corrected_volatile=7)  # not a fault
    assert alarm(HEALTHY, cooler, []) == ""


def test_faults_are_sent_at_once() -> None:
    assert alarm(HEALTHY, HEALTHY, [XidEvent(gpu=1, code=79, time=0.0)]) == "XID 79 on GPU 1"
    assert "ecc_uncorrected_volatile rose to 1" in alarm(
        HEALTHY, changed(0, ecc_uncorrected_volatile=1), [])
    assert "ecc_uncorrected_aggregate" in alarm(
        HEALTHY, changed(1, ecc_uncorrected_aggregate=4), [])
    assert alarm(HEALTHY, changed(1, remapped_rows_pending=True), []) == \
        "GPU 1: remapped_rows_pending"
    assert alarm(HEALTHY, changed(0, remapped_rows_failure=True), []) == \
        "GPU 0: remapped_rows_failure"
    assert alarm(HEALTHY, HEALTHY[:1], []) == "GPU 1 no longer read"


def test_a_fault_already_sent_is_not_sent_again() -> None:
    pending = changed(1, remapped_rows_pending=True, ecc_uncorrected_volatile=2)
    assert alarm(pending, pending, []) == ""
    # unreadable counters (None) are no rise
    assert alarm(HEALTHY, changed(0, ecc_uncorrected_volatile=None), []) == ""
