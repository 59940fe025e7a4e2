"""In-place recovery's rules without a multi-rank job: what is absorbed, the loop's course,
where the job store is, and the NCCL path's decisions (run on CPU with a real gloo group)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed import TCPStore

from trainguard import Guard
from trainguard.client import DrillCrash
from trainguard.contract import envnames
from trainguard.contract.schemas import RecoveryReport
from trainguard.recovery.inplace import (
    NCCL_CLEANUP_ONLY,
    agent_store_address,
    comm_device,
    init_process_group,
    nccl_error_handling,
    needs_abort,
    teardown,
)
from trainguard.recovery.peerloss import is_peer_loss
from trainguard.runtime.embedded import free_port

GLOO_RESET = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
              "[127.0.0.1]:41877: Connection reset by peer")


def shape_mismatch() -> RuntimeError:
    try:
        torch.ones(3) + torch.ones(4)
    except RuntimeError as exc:
        return exc
    raise AssertionError("no error from a shape mismatch")


@pytest.mark.parametrize("error", [
    RuntimeError(GLOO_RESET),
    RuntimeError("[pair.cc:598] Connection closed by peer [127.0.0.1]:29500"),
    dist.DistBackendError("NCCL communicator was aborted on rank 1"),
    dist.DistNetworkError("recv failed"),
    dist.DistStoreError("store timeout"),
    RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there "
                 "was a network error, NCCL version 2.21.5 ncclRemoteError"),
    RuntimeError("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9)"),
], ids=["gloo-reset", "gloo-closed", "DistBackendError", "DistNetworkError",
        "DistStoreError", "nccl-remote", "nccl-watchdog"])
def test_a_lost_peer_is_absorbed(error: BaseException) -> None:
    assert is_peer_loss(error)


@pytest.mark.parametrize("error", [
    DrillCrash("crash drill"),
    ValueError("connection reset by peer"),  # the text alone is not enough: the type counts
    shape_mismatch(),
    RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    KeyboardInterrupt(),
], ids=["DrillCrash", "ValueError", "shape-mismatch", "oom", "KeyboardInterrupt"])
def test_the_trainers_own_errors_are_not(error: BaseException) -> None:
    assert not is_peer_loss(error)


class Scripted:
    """A Recovery of the test's own: absorbs what ``absorb`` says, resumes at ``resume``."""

    def __init__(self, absorb: Callable[[BaseException], bool], resume: int) -> None:
        self.absorb, self.resume = absorb, resume
        self.recovered: list[tuple[int, BaseException]] = []
        self.hooks: list[Callable[[], None]] = []
        self.teardowns: list[Callable[[], None]] = []
        self.regrouped: list[int] = []

    @property
    def enabled(self) -> bool:
        return False  # the test process must not end at an exception (the fast exit)

    @property
    def generation(self) -> int:
        return 1

    @property
    def joining(self) -> bool:
        return False

    def absorbs(self, error: BaseException) -> bool:
        return self.absorb(error)

    def begin(self, start: int) -> int:
        return start

    def recover(self, failed_step: int, error: BaseException) -> int:
        for fn in self.teardowns:  # as InPlace does before it tears the group down
            fn()
        self.recovered.append((failed_step, error))
        return self.resume

    def watched_generation(self) -> int:
        return 1

    def regroup(self, completed: int) -> int:
        self.regrouped.append(completed)
        return completed + 1

    def on_regroup(self, fn: Callable[[], None], *, after_sync: bool = False,
                   rebuilds_model: bool = False) -> None:
        self.hooks.append(fn)

    def on_teardown(self, fn: Callable[[], None]) -> None:
        self.teardowns.append(fn)


@pytest.fixture
def guard() -> Iterator[Guard]:
    g = Guard(job="unit", rank=0, world_size=1, enabled=False, checkpoint_every=4)
    yield g
    g.close()


def test_an_absorbed_step_is_abandoned_and_run_again(guard: Guard) -> None:
    rec = Scripted(lambda e: isinstance(e, ConnectionError), resume=5)
    guard.set_recovery(rec)
    ran, completed, checkpoints = [], [], []
    failed_once = False
    for step in guard.steps(0, 9):
        ran.append(step)
        with guard.step(step):
            if step == 7 and not failed_once:
                failed_once = True
                raise ConnectionError("peer gone")
        if guard.abandoned == step:
            assert not guard.should_checkpoint(step)
            continue
        completed.append(step)
        if guard.should_checkpoint(step):
            checkpoints.append(step)
    assert ran == [0, 1, 2, 3, 4, 5, 6, 7, 5, 6, 7, 8]
    assert [s for s, _ in rec.recovered] == [7]
    assert guard.last_completed_step == 8 and 7 not in completed[:7]
    assert checkpoints == [3, 7]  # step 7 is saved once it really completed


def test_a_peer_lost_after_a_step_completed_abandons_no_step(guard: Guard) -> None:
    """Lost in the command agreement at step 7's end: 7 completed here (its update is in
    the parameters, and on the ranks that saw the loss inside step 8 too), so its per-step
    work runs as everywhere else and the group resumes after it; only no save is tried on
    the broken group."""
    rec = Scripted(lambda e: isinstance(e, ConnectionError), resume=8)
    guard.set_recovery(rec)
    ran, completed, checkpoints = [], [], []
    for step in guard.steps(0, 10):
        ran.append(step)
        with guard.step(step):
            pass
        if step == 7 and not rec.recovered:
            assert guard.commands._absorbs(7, ConnectionError("peer gone"))  # as agree() does
        if guard.abandoned == step:
            continue
        completed.append(step)
        if guard.should_checkpoint(step):
            checkpoints.append(step)
    assert ran == list(range(10)) and completed == list(range(10))
    assert [s for s, _ in rec.recovered] == [8]  # the first step the loss kept from running
    assert checkpoints == [3]  # not 7: the group was re-forming


def test_other_errors_go_through_and_a_range_loop_absorbs_nothing(guard: Guard) -> None:
    guard.set_recovery(Scripted(lambda e: isinstance(e, ConnectionError), resume=0))
    with pytest.raises(ValueError, match="bad batch"):
        for step in guard.steps(0, 3):
            with guard.step(step):
                raise ValueError("bad batch")
    with pytest.raises(ConnectionError):  # a range() loop could not run the step again
        for step in range(3):
            with guard.step(step):
                raise ConnectionError("peer gone")


def test_a_failed_recovery_ends_the_loop_with_its_error(guard: Guard) -> None:
    class GivesUp(Scripted):
        def recover(self, failed_step: int, error: BaseException) -> int:
            raise error

    guard.set_recovery(GivesUp(lambda e: True, resume=0))
    with pytest.raises(ConnectionError, match="peer gone"):
        for step in guard.steps(0, 3):
            with guard.step(step):
                raise ConnectionError("peer gone")


def test_rewind_needs_the_steps_loop(guard: Guard) -> None:
    with pytest.raises(RuntimeError, match=r"guard\.steps"):
        guard.rewind(3)
    seen = []
    for step in guard.steps(0, 8):
        seen.append(step)
        with guard.step(step):
            pass
        if step == 5 and seen.count(5) == 1:
            guard.rewind(2)
    assert seen == [0, 1, 2, 3, 4, 5, 2, 3, 4, 5, 6, 7]


LAUNCH = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1",
          "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "r1", envnames.GENERATION: "3"}


def test_the_job_store_is_found_only_under_trainguard_launch() -> None:
    assert agent_store_address(LAUNCH) == ("127.0.0.1", 29400, "r1", 3)
    plain = {k: v for k, v in LAUNCH.items() if k != envnames.GENERATION}
    assert "TRAINGUARD_GENERATION" in str(agent_store_address(plain))
    private = {**LAUNCH, "TORCHELASTIC_USE_AGENT_STORE": "False"}
    assert "no agent store" in str(agent_store_address(private))
    assert "unreadable" in str(agent_store_address({**LAUNCH, "MASTER_PORT": "x"}))


def test_nccl_aborts_first_and_keeps_the_process_alive() -> None:
    assert needs_abort("nccl") and needs_abort("cpu:gloo,cuda:nccl")
    assert not needs_abort("gloo")
    # Modes 1 and 3 (and torch's default, unset) tear the process down on an NCCL error.
    for mode in ("", "1", "3"):
        assert nccl_error_handling({"TORCH_NCCL_ASYNC_ERROR_HANDLING": mode}) == \
            NCCL_CLEANUP_ONLY
    for mode in ("0", "2"):
        assert nccl_error_handling({"TORCH_NCCL_ASYNC_ERROR_HANDLING": mode}) is None
    assert comm_device("gloo") == torch.device("cpu")


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> Iterator[TCPStore]:
    """A one-rank job under a stand-in agent store (a real TCPStore)."""
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10),
                     wait_for_workers=False)
    env = {**LAUNCH, "MASTER_PORT": str(port), envnames.RANK: "0",
           envnames.WORLD_SIZE: "1", "GLOO_SOCKET_IFNAME": "lo"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    yield store
    if dist.is_initialized():
        dist.destroy_process_group()


def test_teardown_aborts_a_real_group_then_destroys_it(one_rank: TCPStore,
                                                       guard: Guard) -> None:
    rec = init_process_group(guard, "gloo", timeout=10)
    assert rec.enabled and rec.generation == 3 and guard.recovery is rec
    assert dist.get_world_size() == 1
    teardown("nccl")  # the abort path on a group that has one: gloo's
    assert not dist.is_initialized()
    rec.form(4)  # a new generation forms on the same job store
    assert dist.is_initialized() and rec.generation == 4


def test_plain_torchrun_is_a_plain_group_with_in_place_off(
        monkeypatch: pytest.MonkeyPatch, guard: Guard) -> None:
    port = free_port()
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), envnames.RANK: "0",
                 envnames.WORLD_SIZE: "1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv(envnames.GENERATION, raising=False)
    guard.joining = True  # as if TRAINGUARD_JOIN=peers: with no job store it cannot join
    try:
        rec = init_process_group(guard, "gloo", timeout=10)
        assert not rec.enabled and "no agent store" in rec.off_reason
        assert not guard.joining  # so its resume_point() loads the checkpoint as a restart
        reports: list[RecoveryReport] = []
        monkeypatch.setattr(guard, "publish_recovery", reports.append)
        assert not rec.absorbs(RuntimeError(GLOO_RESET))  # reported as a restart instead
        # Seen first in the command agreement, the loss fails the next collective too:
        # the group hears of this rank's restart once.
        assert not rec.absorbs(RuntimeError(GLOO_RESET))
        assert [r.path for r in reports] == ["restart"]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_after_a_re_form_collective_commands_wait_for_the_groups_first_step() -> None:
    """Run on arrival, a collective command would run at a different step on each rank
    (the replacement came after its peers had it); kept, it runs once the re-formed
    group completed its first step and rebuilt its agreement (none with one rank: then
    locally, at that step)."""
    from trainguard.client.commands import Queued
    from trainguard.contract.schemas import Command

    g = Guard(job="unit", rank=0, world_size=1, nats_url=f"nats://127.0.0.1:{free_port()}",
              sync_every=1000, checkpoint_every=10)
    try:
        desk = g.commands
        desk.safe_point(0)  # the first boundary
        desk.regrouped()
        desk.inbox.append(Queued(Command(id="i1", job="unit", kind="set_interval", seq=1,
                                         issuer="coordinator",
                                         params={"every_steps": 7, "from_step": 30}),
                                 None, 0.0))
        desk.safe_point(None)  # entering the step the re-formed group continues at
        assert desk.executed == [] and g.checkpoint_interval == (10, 0)
        desk.safe_point(21)  # its first completed step
        assert desk.executed == ["i1"] and g.checkpoint_interval == (7, 30)
    finally:
        g.close(timeout=1.0)


def test_an_agreed_newer_generation_regroups_after_the_step_that_agreed() -> None:
    """A host taken back in place: nothing failed, the loop re-forms after the step and
    goes on with the next one (no step repeated, none skipped)."""
    from trainguard.recovery.loop import Loop, iterate

    rec = Scripted(lambda e: False, resume=0)
    loop, seen, notes = Loop(), [], []
    for step in iterate(loop, 0, 6, rec, notes.append):
        seen.append(step)
        if step == 2:
            loop.regroup = True
    assert seen == [0, 1, 2, 3, 4, 5]
    assert rec.regrouped == [2] and notes == [3]


def test_agreements_come_every_sync_period_at_most_sync_every_steps_apart() -> None:
    """A rollback or save-now waits for the next agreement: its boundaries follow the step
    time (``sync_period`` worth of steps), capped at ``sync_every``, and the group takes
    the largest interval any rank proposes (the all-reduce is a MAX). A re-formed group
    agrees at its first step, then goes on by its step time."""
    from trainguard.client.commands import CommandDesk

    g = Guard(job="unit", rank=0, world_size=2, nats_url=f"nats://127.0.0.1:{free_port()}")
    now = [0.0]
    peer = [0]  # what the other rank proposes
    agreed_at: list[int] = []
    built_at: list[int] = []

    def agreement(local: Sequence[int]) -> list[int]:
        agreed_at.append(desk.last_completed or 0)
        return [local[0], local[1], max(local[2], peer[0]), local[3]]

    def find(world_size: int) -> Callable[[Sequence[int]], list[int]]:
        built_at.append(desk.last_completed or 0)
        return agreement

    desk = CommandDesk(g.identity, g.subjects, g.transport, sync_every=20, sync_period=0.25,
                       clock=lambda: now[0], find=find)

    def run(steps: range, step_s: float) -> list[int]:
        agreed_at.clear()
        for n in steps:
            now[0] += step_s
            desk.note_completed(n)
            desk.safe_point(n)
        return list(agreed_at)

    try:
        def gaps(at: list[int]) -> list[int]:
            return [b - a for a, b in itertools.pairwise(at)]

        # The first boundary (a multiple of sync_every) builds the agreement; with no
        # step time yet it agrees again at the next step, then 5 steps make a period.
        assert run(range(0, 20), 0.05) == [0, 1, 6, 11, 16] and built_at == [0]
        assert gaps(run(range(20, 200), 0.001))[-2:] == [20, 20]  # fast: sync_every apart
        assert gaps(run(range(200, 240), 1.0))[-3:] == [1, 1, 1]  # slow: every step
        peer[0] = 7
        assert gaps(run(range(240, 270), 1.0))[-2:] == [7, 7]  # the peer's larger interval
        # A rollback in place to step 100, at one step on every rank: the next agreement
        # is at the first step back, not 170 steps on.
        assert run(range(101, 116), 1.0)[:2] == [101, 108]
        peer[0] = 0
        desk.note_completed(300)  # the group re-formed and goes on after step 300
        desk.regrouped()
        assert run(range(301, 305), 1.0) == [301, 302, 303, 304] and built_at == [0, 301]
    finally:
        g.close(timeout=1.0)


def test_a_job_resumed_anywhere_agrees_soon_and_drops_what_its_group_ran_before() -> None:
    """The first agreement of a job resumed at step 1337 comes at 1340, not at the next
    multiple of ``sync_every=1000``; a collective command that reaches a rank after its
    group agreed on it (a rank that joined since) is neither run nor handed on."""
    from trainguard.client.commands import CommandDesk, Queued
    from trainguard.contract.schemas import Command

    g = Guard(job="unit", rank=0, world_size=2, nats_url=f"nats://127.0.0.1:{free_port()}")
    agreed_at: list[int] = []

    def agreement(local: Sequence[int]) -> list[int]:
        agreed_at.append(desk.last_completed or 0)
        return list(local)

    desk = CommandDesk(g.identity, g.subjects, g.transport, sync_every=1000,
                       find=lambda _: agreement)
    try:
        for n in range(1337, 1342):
            desk.note_completed(n)
            desk.safe_point(n)
        assert agreed_at[:1] == [1340]
        desk.adopt_agreed(5)
        for seq in (4, 6):
            desk.inbox.append(Queued(Command(id=f"s{seq}", job="unit", kind="set_interval",
                                             seq=seq, issuer="coordinator",
                                             params={"every_steps": 7}), None, 0.0))
        desk.safe_point(None)
        assert [c.id for c in desk.scheduled] == ["s6"]
    finally:
        g.close(timeout=1.0)


def test_commands_sent_before_a_restarted_group_listened_are_not_waited_for() -> None:
    """A group restarted after seq 1-4 never gets them: at its first agreement on seq 5 it
    must run 5 at once, not wait ``collective_timeout`` for commands no rank holds (the
    chaos suite's SDC rollback stalled the group 30 s, and the stall read as a hang)."""
    from trainguard.client.commands import NONE_HELD, CommandDesk, Queued
    from trainguard.contract.schemas import Command

    g = Guard(job="unit", rank=0, world_size=2, nats_url=f"nats://127.0.0.1:{free_port()}")

    def agreement(local: Sequence[int]) -> list[int]:
        # The peer has seen seq 5 announced but holds nothing yet: its copy is in flight.
        return [max(local[0], 5), local[1], local[2], max(local[3], -NONE_HELD)]

    desk = CommandDesk(g.identity, g.subjects, g.transport, sync_every=10,
                       find=lambda _: agreement)
    desk.collective_timeout = 60.0
    ran: list[str] = []
    desk.handlers["set_interval"] = lambda cmd: ran.append(cmd.id) or ""
    try:
        desk.note_completed(9)
        desk.safe_point(9)  # builds the agreement; nothing held yet
        desk.inbox.append(Queued(Command(id="s5", job="unit", kind="set_interval", seq=5,
                                         issuer="coordinator", params={"every_steps": 7}),
                                 None, 0.0))
        t0 = time.monotonic()
        desk.note_completed(10)
        desk.safe_point(10)
        assert time.monotonic() - t0 < 30  # not the 60 s wait for seqs 1-4
        assert ran == ["s5"] and desk.agreed_seq == 5
    finally:
        g.close(timeout=1.0)


def test_a_lost_peer_in_the_command_agreement_re_forms_the_group() -> None:
    """The agreement is a collective too: a peer lost there must re-form the group after
    the step it follows. Run locally, the held commands let this rank go on into the next
    collective, which waits for peers that are re-forming without it (the data-integrity
    drill stalled 60 s there, and the job restarted cold)."""
    from trainguard.client.commands import Queued
    from trainguard.contract.schemas import Command

    g = Guard(job="unit", rank=0, world_size=2, nats_url=f"nats://127.0.0.1:{free_port()}",
              sync_every=4, sync_period=0.0)
    rec = Scripted(lambda e: isinstance(e, RuntimeError), resume=8)
    g.set_recovery(rec)

    def agreement(local: Sequence[int]) -> list[int]:
        if g.commands.last_completed == 7:
            raise RuntimeError(GLOO_RESET)
        return list(local)

    g.commands._find = lambda _: agreement
    ran: list[tuple[str, int | None]] = []
    g.commands.handlers["set_interval"] = \
        lambda cmd: ran.append((cmd.id, g.commands.last_completed)) or ""
    steps: list[int] = []
    try:
        for step in g.steps(0, 10):
            steps.append(step)
            if step == 7:
                g.commands.inbox.append(Queued(Command(
                    id="s1", job="unit", kind="set_interval", seq=1, issuer="coordinator",
                    params={"every_steps": 7}), None, 0.0))
            with g.step(step):
                pass
        # step 7 completed; the failure kept step 8 from starting
        assert [s for s, _ in rec.recovered] == [8]
        assert steps == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
        assert ran == [("s1", 8)]  # held for the re-formed group, not run alone at step 7
    finally:
        g.close(timeout=1.0)


def test_the_agreements_side_group_is_let_go_before_the_teardown() -> None:
    """A peer that lost no peer of its own waits in the agreement on this rank: until this
    rank drops the side group, its sockets stay open and that peer waits out the 60 s
    collective timeout (the demo's hang and ECC drills came back in 61 s, not 2 s)."""
    g = Guard(job="unit", rank=0, world_size=2, nats_url=f"nats://127.0.0.1:{free_port()}",
              sync_every=1, sync_period=0.0)
    rec = Scripted(lambda e: isinstance(e, RuntimeError), resume=4)
    g.set_recovery(rec)
    held: list[bool] = []

    def agreement(local: Sequence[int]) -> list[int]:
        if g.commands.last_completed == 2:
            raise RuntimeError(GLOO_RESET)
        return list(local)

    g.commands._find = lambda _: agreement
    rec.teardowns.append(lambda: held.append(g.commands.agreement is not None))
    try:
        for step in g.steps(0, 5):
            with g.step(step):
                pass
        assert [s for s, _ in rec.recovered] == [3]
        assert held == [False]
    finally:
        g.close(timeout=1.0)
