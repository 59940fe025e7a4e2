"""The diagnoser's use of flight-recorder reports, the agent's host OOM evidence and the
rank's dump trigger, without a bus: real fixture dumps, real files, a real (one-rank) gloo
group."""

from __future__ import annotations

import datetime
import pickle
from pathlib import Path

import pytest

from tests.unit.test_flightrec import FIXTURES, faulted
from trainguard.agent.hostmem import PREFIX, OomWatch
from trainguard.analysis import flightrec
from trainguard.client.frdump import DUMP_FILE, Trigger
from trainguard.contract import envnames
from trainguard.contract.evidence import FlightRecorderEvidence, HangEvidence
from trainguard.contract.schemas import Anomaly, FlightRecorderReport
from trainguard.services.diagnoser.flightrec import FlightRecorder
from trainguard.services.diagnoser.rules import Diagnoser

NOW = 1_000_000.0
HOSTS = {"node-a": range(0, 8), "node-b": range(8, 16)}


def reports(name: str, hosts: dict[str, range] = HOSTS) -> list[FlightRecorderReport]:
    records = {r.rank: r for r in flightrec.read_dir(str(FIXTURES / name))}
    return [FlightRecorderReport(id=f"fr-{host}", job="j", host=host, time=NOW - 1,
                                 evidence=FlightRecorderEvidence(
                                     asked=list(ranks),
                                     records=[records[r] for r in ranks]))
            for host, ranks in hosts.items()]


def hang_everyone_in_comm(d: Diagnoser) -> None:
    a = Anomaly(id="h1", job="j", kind="hang", ranks=list(range(16)),
                hosts=list(HOSTS), onset_at=NOW - 30, detected_at=NOW - 2,
                evidence=HangEvidence(majority_phase="comm"))
    (guess,) = d.on_anomaly(a, NOW - 2).publish
    assert guess.cause == "network"


@pytest.mark.parametrize("name", ["gpu_error_1st", "lock_gil_1st"])
def test_dumps_name_the_culprits_of_the_open_hang(name: str) -> None:
    rules, fr = Diagnoser(), FlightRecorder()
    hang_everyone_in_comm(rules)
    first, second = reports(name)
    late = faulted(name)
    # One host's dumps alone: members it was not asked for are not "missing".
    partial = fr.on_report(rules, first, NOW).publish
    assert all(set(d.ranks) <= set(range(8)) for d in partial)
    (d,) = fr.on_report(rules, second, NOW).publish
    assert d.cause == "rank_hang" and d.ranks == late
    assert d.hosts == sorted({h for h, rs in HOSTS.items() for r in late if r in rs})
    assert d.recommended[0] == "dump"
    item = d.evidence[-1]
    assert item.source == "flight_recorder" and item.value["culprits"] == late
    assert fr.on_report(rules, second, NOW).publish == []  # redelivered


def test_no_open_hang_no_update() -> None:
    rules, fr = Diagnoser(), FlightRecorder()
    for rep in reports("lock_gil_1st"):
        assert fr.on_report(rules, rep, NOW).publish == []


def test_host_oom_evidence_from_the_cgroup_counter(tmp_path: Path) -> None:
    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    watch = OomWatch(files=[str(events)], kmsg=None)
    assert watch.evidence() == ""
    events.write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\n")
    line = watch.evidence()
    assert line.startswith(PREFIX) and "oom_kill 1 -> 2" in line
    assert watch.evidence() == line  # the next worker of the same kill hears it too


def test_host_oom_evidence_from_the_kernel_log(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"  # /dev/kmsg's record format, one record per read
    kmsg.write_bytes(b"")
    watch = OomWatch(files=[], kmsg=str(kmsg))
    with open(kmsg, "ab") as f:
        f.write(b"3,1234,5678,-;Out of memory: Killed process 4254 (python3) total-vm:1kB")
    assert "Killed process 4254" in watch.evidence()
    watch.close()


def test_rank_dumps_on_a_new_request_only(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    dist = torch.distributed
    request = tmp_path / "fr-request"
    env = {envnames.FR_REQUEST: str(request), DUMP_FILE: str(tmp_path / "dump_")}
    assert Trigger.from_env(0, {}) is None
    request.write_text("old")
    trigger = Trigger.from_env(0, env)
    assert trigger is not None
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        dist.all_reduce(torch.ones(2))
        trigger.poll()
        assert not (tmp_path / "dump_0").exists()  # a request older than the rank
        request.write_text("r1")
        trigger.poll()
        dump = pickle.loads((tmp_path / "dump_0").read_bytes())
        assert (tmp_path / "dump_0.id").read_text() == "r1"
        rec = flightrec.summarize(dump, 0)
        assert rec.groups["0"].enqueued >= 1
    finally:
        dist.destroy_process_group()
