"""Every pre-flight check against recorded readings, healthy and failing
(tests/fixtures/health/, sources in its README)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainguard.contract.errors import ConfigError
from trainguard.contract.evidence import CpuLoad
from trainguard.health import checks, dcgm, kernlog, nvsmi, preflight, procfs, sysfs
from trainguard.health.bandwidth import BandwidthResult
from trainguard.health.disk import DiskResult, write_throughput
from trainguard.health.probe import foreign_processes
from trainguard.health.settings import PreflightSettings
from trainguard.runtime.config import load_settings

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "health"


def gpu(name: str) -> nvsmi.GpuStats:
    (g,) = nvsmi.gpus((FIX / "nvml" / f"{name}.txt").read_text())
    return g


def statuses(found: list[checks.PreflightCheck]) -> dict[str, str]:
    return {c.name: c.status for c in found}


def test_a_healthy_gpu_passes_every_nvml_check() -> None:
    g = gpu("healthy")
    assert (g.name, g.pcie_width, g.pcie_width_max, g.sm_clock_mhz) == \
        ("NVIDIA H100 80GB HBM3", 16, 16, 345.0)
    assert set(statuses(checks.nvml([g])).values()) == {"ok"}


@pytest.mark.parametrize(("reading", "check", "words"), [
    ("throttled", "nvml.clocks:gpu0", "hw_slowdown, hw_thermal_slowdown"),
    ("ecc-pending", "nvml.ecc:gpu0", "4 uncorrectable"),
    ("ecc-pending", "nvml.remap:gpu0", "wait to be remapped"),
    ("pcie-x8", "nvml.pcie:gpu0", "x8 of x16"),
])
def test_each_recorded_fault_fails_its_check(reading: str, check: str, words: str) -> None:
    found = {c.name: c for c in checks.nvml([gpu(reading)])}
    assert found[check].status == "fail"
    assert words in found[check].reason
    others = {n: c.status for n, c in found.items() if n != check and c.status == "fail"}
    if reading != "throttled":  # the throttled GPU also runs a (foreign here) process
        assert others == {} or reading == "ecc-pending", others


def test_a_process_already_on_the_gpu_is_a_warning_not_a_failure() -> None:
    """A previous attempt still exiting, or another tenant: the node is not broken."""
    found = {c.name: c for c in checks.nvml([gpu("foreign-process")])}
    assert found["nvml.processes:gpu0"].status == "warn"
    assert "[3192]" in found["nvml.processes:gpu0"].reason
    assert checks.processes(gpu("foreign-process"), {3192}).status == "ok"


def test_a_fatal_xid_logged_over_an_hour_ago_warns_a_recent_one_fails() -> None:
    lines = kernlog.parse((FIX / "kernel" / "xid.log").read_text())  # Xid 79 at 1843.3 s
    assert checks.kernel_log(lines, uptime=1843.3 + 600).status == "fail"
    old = checks.kernel_log(lines, uptime=1843.3 + 2 * checks.KERNEL_WINDOW_S)
    assert old.status == "warn" and "over an hour ago" in old.reason
    stamped = kernlog.parse_line("6,2171,1843308145,-;NVRM: Xid (PCI:0000:44:00): 79, "
                                 "GPU has fallen off the bus.")
    assert stamped is not None and stamped.since_boot == 1843.308145


def test_a_lower_pcie_generation_on_an_idle_gpu_is_no_fault() -> None:
    g = gpu("healthy")
    g.pcie_gen = 1
    assert checks.pcie(g).status == "ok"
    g.throttle_reasons = []
    assert checks.pcie(g).status == "warn"


def test_the_jobs_own_process_is_not_foreign() -> None:
    assert checks.processes(gpu("foreign-process"), {3192}).status == "ok"


def test_dcgm_pass_and_fail_tables() -> None:
    ok = checks.dcgm(dcgm.parse((FIX / "dcgm" / "pass.txt").read_text()), 1)
    assert ok.status == "ok" and ok.value["pass"] == 11
    bad = checks.dcgm(dcgm.parse((FIX / "dcgm" / "fail.txt").read_text()), 1)
    assert bad.status == "fail" and bad.value == {"pass": 8, "fail": 1, "warn": 0, "skip": 2}
    assert "Page Retirement/Row Remap: GPU 0 There are 4 pending row remappings" in bad.reason


def test_dcgm_absent_is_skipped_with_the_reason() -> None:
    run = dcgm.run(1, 5.0, binary="dcgmi-not-installed-here")
    assert run.missing == "dcgmi-not-installed-here is not installed (DCGM absent)"


def test_infiniband_ports_healthy_degraded_and_down() -> None:
    healthy = sysfs.ib_ports(str(FIX / "ib" / "healthy"))
    assert [(p.name, p.state, p.phys_state, p.rate_gbps, p.link_layer) for p in healthy[:1]] \
        == [("mlx5_0/1", "ACTIVE", "LinkUp", 200.0, "InfiniBand")]
    # The 100 Gb/sec RoCE NIC is held against its own link layer, not the HDR ports.
    assert set(statuses(checks.ib(healthy, 0)).values()) == {"ok"}
    degraded = statuses(checks.ib(sysfs.ib_ports(str(FIX / "ib" / "degraded")), 0))
    assert degraded.pop("ib:mlx5_1/1") == "fail" and set(degraded.values()) == {"ok"}
    down = {c.name: c for c in checks.ib(sysfs.ib_ports(str(FIX / "ib" / "down")), 0)}
    assert down["ib:mlx5_2/1"].status == "fail"
    assert "DOWN/Polling" in down["ib:mlx5_2/1"].reason


def test_an_expected_rate_fails_every_port_below_it() -> None:
    ports = sysfs.ib_ports(str(FIX / "ib" / "healthy"))
    found = statuses(checks.ib(ports, 400.0))
    assert set(found.values()) == {"fail"}


def test_no_infiniband_is_skipped(tmp_path: Path) -> None:
    assert statuses(checks.ib(sysfs.ib_ports(str(tmp_path)), 0)) == {"ib": "skipped"}


def test_kernel_log_fatal_xids_fail_application_xids_warn() -> None:
    bad = checks.kernel_log(kernlog.parse((FIX / "kernel" / "xid.log").read_text()))
    # 94 (a contained ECC error) restarts the application; 79 loses the GPU.
    assert bad.status == "fail" and "(Xid 79)" in bad.reason
    app = checks.kernel_log(kernlog.parse((FIX / "kernel" / "app-xid.log").read_text()))
    assert app.status == "warn" and app.reason == "kernel logged Xid 13"
    clean = checks.kernel_log(kernlog.parse((FIX / "kernel" / "clean.log").read_text()))
    assert clean.status == "ok"
    assert checks.kernel_log([], readable=False).status == "skipped"


def test_the_kernel_log_reader_reads_what_is_new(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    shutil.copy(FIX / "kernel" / "clean.log", path)
    log = kernlog.KernelLog(str(path))
    assert log.readable and log.read() == []
    with open(path, "a") as f:
        f.write((FIX / "kernel" / "xid.log").read_text())
    assert [k.xid for k in log.read()] == [13, 94, 79]
    assert [k.xid for k in log.read()] == [13, 94, 79]  # nothing new: the same lines
    log.close()
    assert not kernlog.KernelLog(str(tmp_path / "absent")).readable


def test_cpu_steal_and_load_from_recorded_procfs() -> None:
    steal = procfs.CpuSampler(str(FIX / "proc" / "steal")).sample()
    assert steal.steal_pct == pytest.approx(25.12, abs=0.01) and steal.cpus == 4
    assert "25.12% of CPU time stolen" in checks.cpu_contention(steal, steal_pct=10,
                                                                load_ratio=1.5)
    loaded = procfs.CpuSampler(str(FIX / "proc" / "loaded")).sample()
    assert (loaded.load1, loaded.runnable) == (37.84, 41)
    assert checks.cpu_contention(loaded, steal_pct=10, load_ratio=1.5) == \
        "1-minute load 37.84 on 4 CPUs"
    idle = procfs.CpuSampler(str(FIX / "proc" / "idle")).sample()
    assert checks.cpu_contention(idle, steal_pct=10, load_ratio=1.5) == ""


def test_cpu_shares_between_two_looks(tmp_path: Path) -> None:
    root = tmp_path / "proc"
    root.mkdir()
    (root / "stat").write_text("cpu  100 0 100 700 0 0 0 100 0 0\ncpu0 1 0 1 7 0 0 0 1 0 0\n")
    sampler = procfs.CpuSampler(str(root))
    assert sampler.sample().steal_pct == 10.0  # since boot
    (root / "stat").write_text("cpu  150 0 150 700 0 0 0 200 0 0\ncpu0 1 0 1 7 0 0 0 1 0 0\n")
    later = sampler.sample()
    assert (later.steal_pct, later.busy_pct) == (50.0, 100.0)
    assert sampler.sample().steal_pct == 50.0  # no tick passed: the last shares stand


def test_disk_throughput_against_its_floor(tmp_path: Path) -> None:
    measured = write_throughput(str(tmp_path / "ckpt"), 4)
    assert measured.error == "" and measured.mbps > 0 and measured.megabytes == 4
    assert os.listdir(tmp_path / "ckpt") == []  # the test file is gone
    assert checks.disk(measured, 0.001).status == "ok"
    assert checks.disk(measured, 1e9).status == "warn"  # often shared: never keeps a node out
    assert checks.disk(None, 50).status == "skipped"
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert "cannot create checkpoint root" in write_throughput(str(blocked / "x"), 1).error


def test_bandwidth_results_against_their_floor() -> None:
    good = BandwidthResult(busbw_gbps=80.0, backend="nccl", ranks=8)
    assert checks.bandwidth(good, 5.0).status == "ok"
    assert "below 100 GB/s" in checks.bandwidth(good, 100.0).reason
    wrong = BandwidthResult(busbw_gbps=80.0, backend="nccl", ranks=8, exact=False)
    assert "corrupted" in checks.bandwidth(wrong, 5.0).reason
    assert checks.bandwidth(BandwidthResult(skipped="no torch"), 5.0).status == "skipped"


def test_foreign_processes_spare_the_jobs_ranks_and_their_children() -> None:
    g = gpu("healthy")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        g.processes = [child.pid, 999_999_999]
        found = foreign_processes([g], {os.getpid()}, "/proc")
        assert [p.pid for p in found] == [999_999_999]
    finally:
        child.kill()
        child.wait()


def test_the_preflight_counts_a_ranks_children_as_the_jobs() -> None:


    g = gpu("healthy")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        g.processes = [child.pid]
        settings = PreflightSettings(kernel_log="")

        def processes(own: set[int]) -> str:
            report = preflight.run(settings, job="j", host="h", gpus=[g], own=own,
                                   only=["nvml"])
            return {c.name: c.status for c in report.checks}["nvml.processes:gpu0"]

        assert processes({os.getpid()}) == "ok"
        assert processes(set()) == "warn"
    finally:
        child.kill()
        child.wait()


def test_a_bad_setting_names_the_key_and_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"preflight_checks.*unknown check 'gpu'.*nvml, dcgm"):
        load_settings(PreflightSettings, env={"TRAINGUARD_PREFLIGHT_CHECKS": "nvml,gpu"})
    with pytest.raises(ConfigError, match="preflight_disk_mb"):
        load_settings(PreflightSettings, env={"TRAINGUARD_PREFLIGHT_DISK_MB": "0"})


def test_overall_status() -> None:
    r = checks.result
    assert checks.overall([r("a", "ok"), r("b", "skipped")]) == "ok"
    assert checks.overall([r("a", "ok"), r("b", "warn")]) == "warn"
    assert checks.overall([r("a", "fail"), r("b", "warn")]) == "fail"


def test_cpu_contention_without_a_reading() -> None:
    assert checks.cpu_contention(None, steal_pct=1, load_ratio=1) == ""
    assert checks.cpu_contention(CpuLoad(runnable=9, cpus=4), steal_pct=1, load_ratio=2) \
        == "9 runnable tasks on 4 CPUs"


def test_cpu_contention_counts_only_beyond_the_other_hosts() -> None:
    """The same load on every host (one machine's, or the fleet's) slows no host alone."""
    loaded = procfs.CpuSampler(str(FIX / "proc" / "loaded")).sample()
    idle = procfs.CpuSampler(str(FIX / "proc" / "idle")).sample()
    steal = procfs.CpuSampler(str(FIX / "proc" / "steal")).sample()
    assert checks.cpu_contention(loaded, steal_pct=10, load_ratio=1.5, peers=[loaded]) == ""
    assert checks.cpu_contention(steal, steal_pct=10, load_ratio=1.5, peers=[steal]) == ""
    alone = checks.cpu_contention(loaded, steal_pct=10, load_ratio=1.5, peers=[idle, idle])
    assert alone.startswith("1-minute load 37.84 on 4 CPUs (other hosts")
    assert "stolen" in checks.cpu_contention(steal, steal_pct=10, load_ratio=1.5,
                                             peers=[idle])


def test_disk_result_defaults() -> None:
    assert DiskResult().error == ""
