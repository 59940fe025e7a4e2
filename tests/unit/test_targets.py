from __future__ import annotations

import pytest

from trainguard.contract.errors import ConfigError
from trainguard.contract.subjects import Subjects
from trainguard.contract.targets import addressed


def test_agent_kinds_go_to_the_host_naming_the_rank() -> None:
    subject, cmd = addressed(Subjects(), "j", "kill", {}, issuer="cli", rank=3, host="node-b")
    assert subject == "tg.j.cmd.host.node-b" and cmd.params == {"rank": 3}
    subject, cmd = addressed(Subjects(), "j", "xid", {"code": 79}, issuer="cli", host="node-b")
    assert subject == "tg.j.cmd.host.node-b" and cmd.params == {"code": 79}


def test_rank_kinds_go_to_the_rank() -> None:
    subject, cmd = addressed(Subjects(), "j", "slow", {"factor": 2.0}, issuer="cli", rank=1,
                             host="node-a")
    assert subject == "tg.j.cmd.rank.1" and cmd.params == {"factor": 2.0}
    assert cmd.issuer == "cli" and cmd.kind == "slow"


def test_a_missing_target_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="name its host"):
        addressed(Subjects(), "j", "freeze", {}, issuer="cli", rank=1)
    with pytest.raises(ConfigError, match="name the rank"):
        addressed(Subjects(), "j", "nan", {}, issuer="cli", host="node-a")


def test_everyone_goes_to_cmd_all_with_target_all() -> None:
    subject, cmd = addressed(Subjects(), "j", "restart", issuer="remediator", everyone=True,
                             epoch=4, deadline=5.0, retry_of="c1")
    assert subject == "tg.j.cmd.all"
    assert (cmd.target, cmd.epoch, cmd.retry_of) == ("all", 4, "c1")
    assert cmd.deadline is not None and cmd.deadline - cmd.issued_at == 5.0
    with pytest.raises(ConfigError):
        addressed(Subjects(), "j", "restart", issuer="remediator", everyone=True, host="a")


def test_target_is_the_subject_tail() -> None:
    _, to_host = addressed(Subjects(), "j", "dump", issuer="cli", host="node-b")
    _, to_rank = addressed(Subjects(), "j", "nan", issuer="cli", rank=2)
    assert (to_host.target, to_rank.target) == ("host.node-b", "rank.2")
