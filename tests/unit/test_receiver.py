"""The one command-admission rule, as both of its users configure it: a node's agent
(``host-node-b``) and a rank's command desk (``rank-1``)."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import pytest

from tests.unit.test_agent_rules import FakeNode
from trainguard import Guard
from trainguard.agent.executor import CommandExecutor
from trainguard.contract.schemas import AckOutcome, Command
from trainguard.contract.subjects import Subjects
from trainguard.contract.targets import addressed
from trainguard.core.receiver import RUN, Admission, Answer, Drop, Receiver, Unreadable, clip
from trainguard.runtime.embedded import free_port


@dataclass(frozen=True)
class User:
    """How one receiver is addressed: its own kind, a kind it leaves to the other, its
    target and a peer's."""

    name: str
    responder: str
    own: str
    foreign: str
    me: dict[str, object]
    peer: dict[str, object]


AGENT = User("agent", "host-node-b", own="restart", foreign="save_now",
             me={"host": "node-b"}, peer={"host": "node-a"})
RANK = User("rank", "rank-1", own="save_now", foreign="restart", me={"rank": 1},
            peer={"rank": 0})


def receiver(user: User) -> Receiver:
    """The receiver exactly as its user builds it."""
    if user is AGENT:
        return CommandExecutor(FakeNode(host="node-b")).receiver
    guard = Guard(job="j", rank=1, world_size=2, host="node-b",
                  nats_url=f"nats://127.0.0.1:{free_port()}", enabled=False)
    return guard.commands.receiver


def command(kind: str, *, ident: str = "c", to: dict[str, object] | None = None,
            issuer: str = "remediator", epoch: int = 0, retry_of: str | None = None,
            target: str | None = None) -> Command:
    """A command as :func:`addressed` builds it (to everyone unless ``to``), with a fixed id."""
    _, cmd = addressed(Subjects(), "j", kind, issuer=issuer, everyone=to is None,
                       epoch=epoch, retry_of=retry_of, **(to or {}))  # type: ignore[arg-type]
    cmd = msgspec.structs.replace(cmd, id=ident)
    return cmd if target is None else msgspec.structs.replace(cmd, target=target)


History = list[tuple[Command, AckOutcome]]


def case(user: User) -> list[tuple[str, History, Command, Admission]]:
    own, me, peer = user.own, user.me, user.peer
    done = command(own, ident="a")
    return [
        ("own kind to everyone", [], command(own), RUN),
        ("own kind to me", [], command(own, to=me), RUN),
        ("own kind to a peer", [], command(own, to=peer),
         Drop(f"addressed to {command(own, to=peer).target}, not {user.responder}")),
        ("the other receiver's kind", [], command(user.foreign),
         Drop(f"{user.foreign!r} is not run by a {user.name.replace('agent', 'host')}")),
        ("an address this version cannot read", [], command(own, target="group.x"), RUN),
        ("redelivered after done", [(done, "done")], command(own, ident="a"),
         Drop("redelivered: acknowledged already")),
        ("redelivered after failing", [(done, "failed")], command(own, ident="a"),
         Drop("redelivered: acknowledged already")),
        ("retry of a command done", [(done, "done")], command(own, ident="b", retry_of="a"),
         Answer("done", "already done as a")),
        ("retry of a command that failed", [(done, "failed")],
         command(own, ident="b", retry_of="a"), RUN),
        ("retry of a command never seen", [], command(own, ident="b", retry_of="zz"), RUN),
        ("stale epoch", [(command(own, ident="a", epoch=5), "done")],
         command(own, ident="b", epoch=4), Answer("refused", "stale epoch 4 < 5 of remediator")),
        ("the same epoch", [(command(own, ident="a", epoch=5), "done")],
         command(own, ident="b", epoch=5), RUN),
        ("a lower epoch of another issuer", [(command(own, ident="a", epoch=5), "done")],
         command(own, ident="b", epoch=1, issuer="cli"), RUN),
        ("an issuer nobody knows", [], command(own, issuer="mallory"),
         Answer("refused", "unknown issuer 'mallory' (commands come from cli, coordinator, "
                           "remediator)")),
    ]


CASES = [pytest.param(user, history, cmd, expected, id=f"{user.name}: {name}")
         for user in (AGENT, RANK) for name, history, cmd, expected in case(user)]


@pytest.mark.parametrize(("user", "history", "cmd", "expected"), CASES)
def test_admission(user: User, history: History, cmd: Command, expected: Admission) -> None:
    r = receiver(user)
    assert r.responder == user.responder
    for earlier, outcome in history:
        assert r.admit(earlier) == RUN
        r.ack(earlier, outcome)
    assert r.admit(cmd) == expected


def test_kinds_the_agent_does_not_run_are_all_left_to_the_ranks() -> None:
    agent, rank = receiver(AGENT), receiver(RANK)
    for kind in ("note", "save_now", "nan", "set_interval"):  # a trainer's own kind too
        assert isinstance(agent.admit(command(kind)), Drop)
        assert rank.admit(command(kind, ident=kind)) == RUN
    assert isinstance(rank.admit(command("xid", to={"host": "node-b"})), Drop)


def test_a_stale_command_does_not_lower_the_epoch() -> None:
    r = receiver(AGENT)
    r.admit(command("restart", ident="a", epoch=5))
    r.admit(command("restart", ident="b", epoch=3))
    assert r.highest_epoch("remediator") == 5 and r.highest_epoch("cli") == 0


def test_memory_is_bounded_oldest_first() -> None:
    r = Receiver("rank", "0", lambda kind: True, memory=2)
    for ident in ("a", "b", "c"):
        r.ack(command("save_now", ident=ident), "done")
    assert r.admit(command("save_now", ident="a")) == RUN  # forgotten: runs again
    assert isinstance(r.admit(command("save_now", ident="c")), Drop)


def test_the_ack_names_the_responder_and_clips_the_detail() -> None:
    r = Receiver("host", "node-b", lambda kind: True, detail_limit=40)
    cmd = command("dump", ident="d1", to={"host": "node-b"}, issuer="cli")
    ack = r.ack(cmd, "done", "Traceback: " + "x" * 100 + " the last line")
    assert (ack.command_id, ack.job, ack.kind, ack.responder, ack.outcome) == (
        "d1", "j", "dump", "host-node-b", "done")
    assert len(ack.detail) == 40 and ack.detail.startswith("Traceback")
    assert ack.detail.endswith("the last line")
    assert isinstance(r.admit(cmd), Drop)  # acking it recorded it
    assert clip("short", 40) == "short"


@pytest.mark.parametrize("user", [AGENT, RANK], ids=lambda u: u.name)
def test_an_epoch_above_the_issuers_current_one_is_refused_and_fences_nothing(
        user: User) -> None:
    r = receiver(user)
    forged = command(user.own, ident="f", epoch=2**53)
    assert r.raises_epoch(forged)
    assert r.admit(forged, ceiling=7) == Answer(
        "refused", f"epoch {2**53} is above remediator's current epoch 7: not issued by its "
                   "leader")
    assert r.highest_epoch("remediator") == 0  # the real leader's next command still runs
    assert r.admit(command(user.own, ident="g", epoch=7), ceiling=7) == RUN
    assert not r.raises_epoch(command(user.own, ident="h", epoch=7))


def test_an_unreadable_ceiling_refuses_raises_and_runs_the_known_epoch() -> None:
    """The fence fails closed: no epoch is raised on a ceiling nobody could read, and the
    leader already admitted goes on being obeyed."""
    r = receiver(AGENT)
    assert r.admit(command("restart", ident="a", epoch=4), ceiling=4) == RUN
    away = Unreadable("the fence bucket: TimeoutError")
    verdict = r.admit(command("restart", ident="b", epoch=2**53), ceiling=away)
    assert isinstance(verdict, Answer) and verdict.outcome == "refused"
    assert "cannot be read (the fence bucket: TimeoutError)" in verdict.detail
    assert r.highest_epoch("remediator") == 4
    assert r.admit(command("restart", ident="c", epoch=4), ceiling=away) == RUN
