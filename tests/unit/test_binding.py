"""check_bound: a body speaks only for the job, rank or host its subject names."""

from __future__ import annotations

import pytest

from trainguard.contract.binding import check_bound
from trainguard.contract.errors import DecodeError, Misaddressed
from trainguard.contract.schemas import Heartbeat, NodeHello, RankHello, StepReport, WorkerExit
from trainguard.contract.subjects import Subjects

S = Subjects("prod.tg")


def step(job: str = "j", rank: int = 1) -> StepReport:
    return StepReport(job=job, time=0.0, seq=1, rank=rank, step=1, duration=0.1)


def test_a_body_that_agrees_with_its_subject_passes() -> None:
    check_bound(S, S.step("j", 1), step())
    check_bound(S, S.hb("j", 1), Heartbeat(job="j", time=0.0, seq=1, rank=1, host="h9",
                                            step=1, phase="compute", phase_elapsed=0.0))
    check_bound(S, S.reg_node("j", "h"), NodeHello(job="j", host="h", time=0.0))
    check_bound(S, S.reg_rank("j", 3), RankHello(job="j", rank=3, world_size=4, time=0.0))
    # An agent reports its ranks' exits on its host's subject: the rank is not bound.
    check_bound(S, S.exit("j", "h"), WorkerExit(id="x", job="j", host="h", rank=7, time=0.0))
    check_bound(S, "elsewhere.j.step.1", step(rank=2))  # not ours: nothing to bind


@pytest.mark.parametrize(("subject", "body", "names"), [
    (S.step("j", 1), step(rank=2), "rank 2"),
    (S.step("k", 1), step(), "job 'j'"),
    (S.exit("j", "h"), WorkerExit(id="x", job="j", host="g", rank=0, time=0.0), "host 'g'"),
    (S.reg_node("j", "h"), NodeHello(job="j", host="g", time=0.0), "host 'g'"),
    (S.reg_rank("j", 3), RankHello(job="j", rank=4, world_size=8, time=0.0), "rank 4"),
])
def test_a_body_in_another_senders_name_is_misaddressed(subject: str, body: object,
                                                       names: str) -> None:
    with pytest.raises(Misaddressed) as err:
        check_bound(S, subject, body)
    assert names in err.value.reason and subject in err.value.reason
    assert isinstance(err.value, DecodeError)  # dead-lettered like any unreadable message
