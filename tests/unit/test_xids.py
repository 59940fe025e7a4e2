"""The XID table: NVIDIA's catalog, trainguard's rule over it, and one answer for everyone."""

from __future__ import annotations

import importlib.resources
import subprocess
import sys

import msgspec
import pytest

from trainguard.contract.evidence import CrashEvidence
from trainguard.contract.schemas import Anomaly, GpuSample, GpuStats, RankHello, XidEvent
from trainguard.runtime import xids
from trainguard.services.detector.synthetic import Harness, SimConfig
from trainguard.services.detector.thresholds import Thresholds
from trainguard.services.diagnoser.rules import Diagnoser


def catalog_lines() -> list[xids.CatalogLine]:
    folder, name = xids.CATALOG.split("/")
    text = importlib.resources.files("trainguard").joinpath(folder).joinpath(name).read_text()
    return xids.parse(text)


def test_every_catalog_line_parses_once_per_code() -> None:
    lines = catalog_lines()
    codes = [line.xid for line in lines]
    assert len(codes) == len(set(codes)) == 172 and set(codes) == set(range(1, 173))
    assert set(xids.table()) == set(codes)


def test_every_immediate_action_in_the_catalog_is_classified() -> None:
    """A new action in a newer catalog must be placed deliberately, not fall through."""
    actions = {line.action_immediate for line in catalog_lines()} - {""}
    assert actions <= xids.JOB_ACTIONS | xids.MACHINE_ACTIONS
    assert not xids.JOB_ACTIONS & xids.MACHINE_ACTIONS


KNOWN = [
    # code, cause, fatal: what NVIDIA's fields (and the few overrides) say
    (79, "gpu_lost", True),        # fallen off the bus: RESTART_BM
    (95, "gpu_lost", True),        # uncontained memory error: RESET_GPU
    (119, "gpu_lost", True),       # GSP RPC timeout: RESET_GPU
    (48, "hbm_ecc", True),         # double-bit ECC: its workflow
    (64, "hbm_ecc", True),         # row remapping failure: RESET_GPU
    (140, "hbm_ecc", True),        # ECC escaped row remapping: RESET_GPU
    (63, "hbm_ecc", False),        # row remapping event: IGNORE
    (92, "hbm_ecc", False),        # high single-bit rate: IGNORE
    (94, "hbm_ecc", False),        # contained ECC error: RESTART_APP
    (74, "network", True),         # NVLink error: its workflow
    (144, "network", True),        # NVLink5: its workflow
    (13, "process_crash", False),  # graphics engine exception: RESTART_APP
    (31, "process_crash", False),  # MMU fault: RESTART_APP
    (43, "process_crash", False),  # stopped processing: IGNORE
    (162, "gpu_lost", True),       # no action in the catalog: NVSentinel says FATAL
    (163, "process_crash", False),  # no action, no severity
]


@pytest.mark.parametrize(("code", "cause", "fatal"), KNOWN, ids=[str(k[0]) for k in KNOWN])
def test_known_codes(code: int, cause: str, fatal: bool) -> None:
    x = xids.lookup(code)
    assert x is not None and (x.cause, x.fatal) == (cause, fatal)
    assert x.meaning and x.mnemonic
    assert (code in xids.fatal_codes()) == fatal


def test_overrides_only_where_the_rule_would_name_another_cause() -> None:
    lines = {line.xid: line for line in catalog_lines()}
    for code, cause in xids.CAUSE_OVERRIDES.items():
        line = lines[code]
        without = msgspec.structs.replace(line, xid=-1)  # not in the override table
        assert xids.cause_of(without, xids.is_fatal(line)) != cause, code


def test_unknown_codes_have_no_entry() -> None:
    assert xids.lookup(999) is None and xids.lookup(0) is None


def test_a_bad_catalog_line_is_named() -> None:
    good = '{"xid": 1, "mnemonic": "A", "meaning": "m"}'
    with pytest.raises(msgspec.ValidationError, match="line 3"):
        xids.parse(f"{good}\n\n{{\"xid\": \"one\"}}")
    with pytest.raises(msgspec.DecodeError, match="line 2"):
        xids.parse(f"{good}\nnot json")


def test_the_client_never_loads_the_catalog() -> None:
    code = ("import sys, trainguard, trainguard.contract.schemas, trainguard.contract.evidence\n"
            "assert 'trainguard.runtime.xids' not in sys.modules, 'imported'\n"
            "from trainguard.runtime import xids\n"
            "assert xids.table.cache_info().currsize == 0, 'read on import'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(("code", "cause"), [(64, "hbm_ecc"), (74, "network"),
                                             (79, "gpu_lost")])
def test_detector_and_diagnoser_agree_on_fatal_xids(code: int, cause: str) -> None:
    """The detector raises gpu_health for the code; the diagnoser names the table's cause,
    from the anomaly and from the sample alone (a crash with the XID in its window)."""
    h = Harness(Thresholds(), SimConfig(ranks=2, ranks_per_host=2))
    h.detector.on_hello(RankHello(job="sim", rank=1, world_size=2, local_rank=1,
                                  host="node-0"), h.clock)
    h.sim.steps(3)
    sample = GpuSample(job="sim", time=h.clock, host="node-0", gpus=[GpuStats(index=1)],
                       xids=[XidEvent(gpu=1, code=code, time=h.clock)])
    h.feed(sample)
    [gpu] = h.opened("gpu_health")
    assert gpu.ranks == [1] and code in gpu.evidence.fatal_xids  # type: ignore[union-attr]
    d = Diagnoser()
    d.observe_gpu(sample)
    (diag,) = d.on_anomaly(gpu, h.clock).publish
    assert diag.cause == cause and diag.confidence >= 0.95
    assert any(f"XID {code}" in e.fact for e in diag.evidence)
    crash = Anomaly(id="c1", job="sim", kind="crash", ranks=[1], hosts=["node-0"],
                    onset_at=h.clock, detected_at=h.clock,
                    evidence=CrashEvidence(exit_code=1, stderr_tail="RuntimeError: boom"))
    d = Diagnoser()
    d.observe_gpu(sample)
    (diag,) = d.on_anomaly(crash, h.clock).publish
    assert diag.cause == cause and any(f"XID {code} on node-0" in e.fact
                                       for e in diag.evidence)


def test_a_contained_ecc_error_is_not_gpu_health_by_default_but_a_job_may_say_so() -> None:
    assert 94 not in Thresholds().xid_set()
    assert Thresholds(fatal_xids="48,94").xid_set() == {48, 94}
