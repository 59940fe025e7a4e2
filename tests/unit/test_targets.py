from __future__ import annotations

import pytest

from trainguard.errors import ConfigError
from trainguard.subjects import Subjects
from trainguard.targets import addressed


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
