"""The remediator's node-record rules: which hello a host's record keeps, and which records
count as the job's hosts (pure tables; the Redis side is in test_remediator_service.py)."""

from __future__ import annotations

import pytest

from trainguard.contract.codec import decode_durable, encode_durable
from trainguard.contract.schemas import NodeHello
from trainguard.services.remediator import endings


def hello(at: float, *, left: bool = False, host: str = "node-a") -> NodeHello:
    return NodeHello(job="j", host=host, local_ranks=[0], time=at, left=left)


SUPERSEDES = [
    # the hello, the stored record (None: none), whether the hello replaces it
    (hello(10.0), None, True),  # first hello
    (hello(10.0, left=True), None, True),  # a left seen first still records the tombstone
    (hello(20.0), hello(10.0), True),  # a newer hello (a launcher started again)
    (hello(20.0, left=True), hello(10.0), True),  # the launcher left
    (hello(10.0), hello(20.0, left=True), False),  # an older hello redelivered after left
    (hello(30.0), hello(20.0, left=True), True),  # a new launcher on the host after a left
    (hello(10.0, left=True), hello(10.0), True),  # a tie: left wins
    (hello(10.0), hello(10.0, left=True), False),
    (hello(10.0), hello(10.0), False),  # the same hello again: nothing to write
]


@pytest.mark.parametrize(("new", "current", "replaces"), SUPERSEDES)
def test_supersedes(new: NodeHello, current: NodeHello | None, replaces: bool) -> None:
    assert endings.supersedes(new, current) is replaces


IN_JOB = [
    # the record, blocklisted hosts, whether it counts as a host of the job
    (hello(10.0), set(), True),
    (hello(10.0, left=True), set(), False),  # a tombstone
    (hello(10.0), {"node-a"}, False),
    (hello(10.0, host="node-b"), {"node-a"}, True),
]


@pytest.mark.parametrize(("record", "blocked", "counts"), IN_JOB)
def test_in_job(record: NodeHello, blocked: set[str], counts: bool) -> None:
    assert endings.in_job(record, blocked) is counts


def test_an_old_agents_hello_has_not_left_and_left_travels() -> None:
    assert decode_durable(b'{"job": "j", "host": "h", "time": 1.0}', NodeHello).left is False
    raw = encode_durable(hello(5.0, left=True))
    assert decode_durable(raw, NodeHello).left is True
