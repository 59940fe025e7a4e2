"""One valid, fully populated instance of every message type (shared by tests)."""

from __future__ import annotations

from trainguard.analysis.flightrec import GroupStatus, RankRecord
from trainguard.contract import schemas as s
from trainguard.contract.evidence import (
    CpuLoad,
    FlightRecorderEvidence,
    ForeignProcess,
    HostFacts,
    IbPort,
    KernelLine,
    LossSpikeEvidence,
)

TELEMETRY: list[s.TelemetryMessage] = [
    s.Heartbeat(job="j1", time=1.5, seq=3, rank=2, attempt=1, host="node-a", pid=42, step=10,
                phase="comm", phase_elapsed=0.25, coll_seq=7, coll_done=6, dropped=1),
    s.StepReport(job="j1", time=2.0, seq=4, rank=2, step=10, attempt=1, duration=0.1,
                 phases={"data": 0.01, "compute": 0.07, "comm": 0.02}, loss=float("nan"),
                 grad_norm=float("inf"), nonfinite=1, nonfinite_params=["fc.weight"],
                 tokens=4096, samples=8, extra={"lr": 3e-4}),
    s.Fingerprint(job="j1", time=2.1, rank=0, step=100, checksum=-(2**40), group="dp0"),
    s.GpuSample(job="j1", time=3.0, host="node-b", gpus=[s.GpuStats(
        index=0, uuid="GPU-1", name="H200", temperature_c=71.0, power_w=650.0,
        throttle_reasons=["sw_power_cap"], ecc_uncorrected_volatile=2,
        remapped_rows_pending=True, nvlink_errors=0)],
        xids=[s.XidEvent(gpu=0, code=79, time=3.0, detail="fell off the bus")],
        facts=HostFacts(ib_ports=[IbPort(device="mlx5_1", port=1, state="ACTIVE",
                                         phys_state="LinkUp", rate_gbps=100.0,
                                         rate="100 Gb/sec (4X EDR)", link_layer="InfiniBand")],
                        cpu=CpuLoad(steal_pct=25.1, load1=3.9, runnable=4, cpus=4),
                        kernel=[KernelLine(text="NVRM: Xid (PCI:0000:44:00): 79, GPU has "
                                           "fallen off the bus.", xid=79, pci="0000:44:00",
                                           kind="xid")],
                        foreign=[ForeignProcess(gpu=0, pid=3192, name="python", user="1001")])),
    s.NodeHeartbeat(job="j1", time=3.1, host="node-a", ranks={0: "R", 1: "T"},
                    pids={0: 100, 1: 101}),
    s.SnapshotReport(job="j1", time=3.2, seq=5, rank=1, step=120, attempt=1, taken=3.15,
                     bytes=4096, copy_seconds=0.002, check_seconds=0.01, every=2,
                     kept_steps=[100, 118, 120], oldest_taken=1.0, host_bytes=12288, world_size=4),
]

DURABLE: list[s.Durable] = [
    s.RankHello(job="j1", rank=1, world_size=4, host="node-a", pid=7,
                attempt=s.Attempt(restart_count=2, pid=7, started_at=1.0),
                env={"torch": "2.13.0"}),
    s.NodeHello(job="j1", host="node-a", local_ranks=[0, 1], nnodes_min=1, nnodes_max=2,
                drills_allowed=True, hosts_store=True),
    s.WorkerExit(id="e1", job="j1", host="node-a", rank=1, exit_code=1, signal=None,
                 stderr_tail="RuntimeError: CUDA error", initiated_by="launcher"),
    s.FlightRecorderReport(id="f1", job="j1", host="node-b", command_id="cmd1", attempt=1,
                           evidence=FlightRecorderEvidence(asked=[2, 3], records=[
                               RankRecord(rank=2, entries=3, groups={"0": GroupStatus(
                                   name="0", ranks=[0, 1, 2, 3], enqueued=8, completed=7,
                                   frontier="gloo:all_reduce")})])),
    s.CheckpointReport(id="c1", job="j1", rank=0, step=100, path="/ckpt/j1/step-100",
                       world_size=4, bytes=1024, files={"__0_0.distcp": s.FileDigest(
                           bytes=1024, crc32=12345)}),
    s.RecoveryReport(id="r1", job="j1", rank=0, kind="replace", path="in_place",
                     reason="a peer was lost", generation=3, previous_generation=2,
                     world_size=4, joined=[2], source_rank=0, failed_step=41,
                     last_completed=40, resumed_step=41, steps_lost=0, seconds=1.2),
    s.PreflightReport(id="p1", job="j1", host="node-b", status="fail", checks=[
        s.PreflightCheck(name="ib:mlx5_1/1", status="fail", value={"rate_gbps": 100.0},
                         threshold=200.0, reason="port mlx5_1/1 runs at 100 Gb/sec"),
        s.PreflightCheck(name="disk", status="ok", value=850.1, threshold=50.0)],
        seconds=1.5, time=4.0),
    s.Anomaly(id="a1", job="j1", kind="loss_spike", ranks=[1], hosts=["node-a"], step=5,
              onset_at=1.0, detected_at=2.0, evidence=LossSpikeEvidence(
                  loss=float("nan"), baseline_median=2.1, mad=0.05, z=float("inf"), loss_z=6.0,
                  loss_spike_rel=0.3, window=200)),
    s.Diagnosis(id="d1", job="j1", anomaly_ids=["a1"], cause="numeric", confidence=0.9,
                evidence=[s.EvidenceItem(fact="loss is NaN on all ranks", source="step")],
                recommended=["rollback"], summary="NaN loss on all ranks"),
    s.Action(id="x1", job="j1", action="restart", command_ids=["c9"]),
    s.Incident(id="i1", job="j1", cause="numeric", status="mitigating", rev=2,
               recovery=s.RecoveryNote(path="restart", kind="rollback",
                                       reason="rank 1 acked failed"),
               actions=[s.IncidentStep(action="rollback", status="done",
                                       params={"below_step": 40}, command_ids=["c1"])]),
    s.CheckpointCommitted(id="k1", job="j1", step=100, path="/ckpt/j1/step-100",
                          status="failed", missing_ranks=[3], reason="rank 3 did not report"),
    s.Command(id="c9", job="j1", kind="save_now", issuer="remediator", epoch=3,
              params={"deadline_s": 30}, at_step=120, deadline=99.0),
    s.CommandAck(command_id="c9", job="j1", responder="rank-0", outcome="too_late"),
    s.ResumePoint(job="j1", step=100, path="/ckpt/j1/step-100", world_size=4),
    s.DeadLetter(job="j1", subject="tg.j1.event.anomaly", reason="bad", payload=b"\x00\xff"),
]
