"""Guard behaviour that needs no bus: what it queues, intervals, aggregation, cost."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from trainguard import Guard
from trainguard.contract.codec import encode_durable
from trainguard.contract.schemas import Command, Fingerprint, Heartbeat, ResumePoint, StepReport
from trainguard.runtime.embedded import free_port


def offline_guard(**kw: object) -> Guard:
    """A Guard whose NATS URL is dead: everything it publishes stays in its buffers."""
    return Guard(job="offline", rank=0, world_size=1, host="h",
                 nats_url=f"nats://127.0.0.1:{free_port()}", heartbeat_interval=60, **kw)


def queued(guard: Guard, cls: type) -> list:
    return [m for _, m in guard.transport.telemetry if isinstance(m, cls)]


def test_tensor_metrics_are_read_and_nonfinite_grads_named() -> None:
    g = offline_guard()
    model = torch.nn.Linear(4, 2)
    g.attach(model)
    model(torch.ones(1, 4)).sum().backward()
    model.weight.grad[0, 0] = float("inf")
    with g.step(0) as s:
        s.report(loss=torch.tensor(2.5), grad_norm=torch.tensor(float("inf")), lr=1e-3)
    g.close(timeout=0.1)
    (report,) = queued(g, StepReport)
    assert report.loss == 2.5 and math.isinf(report.grad_norm)
    assert report.nonfinite == 1 and report.nonfinite_params == ["weight"]
    assert report.extra == {"lr": 1e-3}


def test_fingerprints_every_n_steps_with_a_model() -> None:
    g = offline_guard(fingerprint_every=5)
    g.attach(torch.nn.Linear(4, 2))
    for i in range(11):
        with g.step(i):
            pass
    g.close(timeout=0.1)
    fps = queued(g, Fingerprint)
    assert [f.step for f in fps] == [0, 5, 10]
    assert len({f.checksum for f in fps}) == 1


def test_report_every_aggregates() -> None:
    g = offline_guard(report_every=4)
    for i in range(8):
        with g.step(i) as s:
            with s.phase("compute"):
                pass
            s.report(loss=float(i), grad_norm=float(i), tokens=10)
    g.close(timeout=0.1)
    reports = queued(g, StepReport)
    assert [(r.step, r.steps, r.tokens, r.grad_norm) for r in reports] == [
        (3, 4, 40, 3.0), (7, 4, 40, 7.0)]


def test_should_checkpoint_follows_set_interval() -> None:
    g = offline_guard(checkpoint_every=10)
    assert [s for s in range(40) if g.should_checkpoint(s)] == [9, 19, 29, 39]
    set_interval = g.commands.handlers["set_interval"]
    set_interval(Command(id="x", job="offline", kind="set_interval", issuer="coordinator",
                         params={"every_steps": 7, "from_step": 20}))
    assert g.checkpoint_interval == (7, 20)
    assert [s for s in range(40) if g.should_checkpoint(s)] == [26, 33]
    g.close(timeout=0.1)


def test_disabled_guard_is_a_no_op() -> None:
    g = offline_guard(enabled=False)
    for i in range(5):
        with g.step(i) as s:
            s.report(loss=1.0)
    g.close(timeout=0.1)
    assert len(g.transport.telemetry) == 0 and not g.started


def test_exceptions_in_the_step_propagate_unchanged() -> None:
    g = offline_guard()
    try:
        with g.step(0):
            raise KeyError("trainer bug")
    except KeyError as exc:
        assert exc.args == ("trainer bug",)
    g.close(timeout=0.1)
    assert queued(g, StepReport) == []


def test_close_is_bounded_and_idempotent() -> None:
    g = offline_guard()
    with g.step(0):
        pass
    t0 = time.monotonic()
    g.close(timeout=0.5)
    g.close(timeout=0.5)
    assert time.monotonic() - t0 < 3


def test_heartbeats_read_the_state_phases_write() -> None:
    g = offline_guard()
    with g.step(4) as s:
        with s.phase("data"):
            hb = g.state.heartbeat(g.identity, dropped=3)
            assert (hb.step, hb.phase, hb.rank, hb.host, hb.dropped) == (4, "data", 0, "h", 3)
            g.state.comm_outstanding = 1  # what the DDP hook does while a collective runs
            assert g.state.heartbeat(g.identity, 0).phase == "comm"
            g.state.comm_outstanding = 0
        assert g.state.phase == "step"
    assert g.state.phase is None
    g.close(timeout=0.1)
    beats = queued(g, Heartbeat)
    assert [b.seq for b in beats] == sorted(b.seq for b in beats) and beats[-1].seq > 2
    assert beats[-1].phase == "closed"  # the last beat: a finished rank, not a silent one


def test_phase_accounting_adjusts_the_report() -> None:
    g = offline_guard()
    g.set_phase_accounting(lambda phases: phases.update(comm=phases.pop("compute") / 2))
    with g.step(0) as s, s.phase("compute"):
        pass
    g.close(timeout=0.1)
    (report,) = queued(g, StepReport)
    assert set(report.phases) == {"comm"}


def test_after_step_runs_once_at_the_next_step_that_ends_or_at_close() -> None:
    g = offline_guard()
    calls: list[float | None] = []
    g.after_step(calls.append)
    try:
        with g.step(0):
            raise ValueError("a failed step is not the way back")
    except ValueError:
        pass
    assert calls == []
    before = time.time()
    with g.step(1):
        pass
    with g.step(2):
        pass
    assert len(calls) == 1 and calls[0] is not None and calls[0] >= before
    g.after_step(calls.append)
    g.close(timeout=0.1)
    assert calls[1:] == [None]  # no step ended before close


def test_a_step_that_ended_holds_none_of_the_trainers_tensors() -> None:
    import weakref

    g = offline_guard()
    loss, norm = torch.tensor(1.5), torch.tensor(0.25)
    refs = [weakref.ref(loss), weakref.ref(norm)]
    with g.step(0) as s:
        s.report(loss=loss, grad_norm=norm, extra_metric=torch.tensor(3.0))
    del loss, norm
    assert [r() for r in refs] == [None, None]  # `s` lives on in the trainer's frame
    assert s.extra is None
    g.close(timeout=0.1)
    (report,) = queued(g, StepReport)
    assert (report.loss, report.grad_norm) == (1.5, 0.25)


def test_the_fast_exit_is_installed_only_where_peers_wait_to_recover_in_place(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from trainguard.client import fastexit

    class Off:  # what init_process_group installs under a plain torchrun
        enabled = False
        watched_generation = 0

        def on_teardown(self, fn: object) -> None:
            pass

    class On(Off):
        enabled = True

    monkeypatch.setattr(fastexit, "_installed", [])
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    hook = sys.excepthook
    offline_guard().set_recovery(Off())  # type: ignore[arg-type]
    assert sys.excepthook is hook
    offline_guard(fast_exit=False).set_recovery(On())  # type: ignore[arg-type]
    assert sys.excepthook is hook
    offline_guard().set_recovery(On())  # type: ignore[arg-type]
    assert sys.excepthook is not hook and len(fastexit._installed) == 1


def test_a_replacement_joining_in_place_gets_no_resume_point(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A replacement that loaded the checkpoint would wait in a collective its peers never
    call: the Guard answers it None, as the Checkpointer does."""
    (tmp_path / "j").mkdir()
    point = ResumePoint(job="j", step=7, path=str(tmp_path / "j" / "step-7"))
    (tmp_path / "j" / "LATEST").write_bytes(encode_durable(point))
    monkeypatch.setenv("TRAINGUARD_JOIN", "peers")
    guard = Guard(job="j", rank=1, world_size=2, enabled=False)
    assert guard.joining and guard.resume_point(str(tmp_path)) is None
    guard.joining = False  # it has joined: a survivor like the others from here on
    found = guard.resume_point(str(tmp_path))
    assert found is not None and found.step == 7
