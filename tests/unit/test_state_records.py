"""The blocklist entry and the node record: what their writers store, their readers get."""

from __future__ import annotations

import pytest

from trainguard.contract.errors import DecodeError
from trainguard.runtime.state import (
    BlocklistEntry,
    NodeRecord,
    decode_blocklist_entry,
    decode_node_record,
    encode_blocklist_entry,
    encode_node_record,
    read_blocklist_entry,
)


def test_a_node_record_is_the_hello_its_agent_sent() -> None:
    hello = NodeRecord(job="j", host="node-b", local_ranks=[2, 3], nnodes_min=2,
                       nnodes_max=4, hosts_store=True, pid=77, time=5.0)
    assert decode_node_record(encode_node_record(hello)) == hello
    assert decode_node_record(encode_node_record(hello).decode()) == hello  # str from Redis
    # Written by a tool, without the envelope's schema and the defaults.
    minimal = decode_node_record('{"job": "j", "host": "node-a", "hosts_store": true}')
    assert (minimal.host, minimal.hosts_store, minimal.nnodes_min) == ("node-a", True, 1)


@pytest.mark.parametrize("raw", [b"", b"[]", b'{"job": "j"}', b'{"job": "j", "host": 3}',
                                 b'{"schema": "io.trainguard.node_hello.v9", "job": "j", '
                                 b'"host": "h"}'])
def test_a_value_that_is_no_record_is_refused(raw: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_node_record(raw)


READ = [
    (encode_blocklist_entry(BlocklistEntry(reason="xid 79", cause="gpu_lost", job="j",
                                           incident="i1", time=9.0)),
     BlocklistEntry(reason="xid 79", cause="gpu_lost", job="j", incident="i1", time=9.0)),
    ('{"reason": "ecc"}', BlocklistEntry(reason="ecc")),  # written by hand
    ("maintenance", BlocklistEntry(reason="maintenance")),  # not JSON: still blocks
    ('{"reason": 3}', BlocklistEntry(reason='{"reason": 3}')),
]


@pytest.mark.parametrize(("raw", "entry"), READ)
def test_reading_the_blocklist(raw: str | bytes, entry: BlocklistEntry) -> None:
    assert read_blocklist_entry(raw) == entry


def test_the_blocklist_codec_is_strict() -> None:
    with pytest.raises(DecodeError, match="bad blocklist entry"):
        decode_blocklist_entry("maintenance")


def test_an_entry_blocks_until_it_ends() -> None:
    forever = BlocklistEntry(reason="by hand")
    assert forever.active(0.0) and forever.active(1e12)  # no expires: until unblocked
    timed = BlocklistEntry(reason="ecc", time=100.0, expires=160.0)
    assert timed.active(159.9) and not timed.active(160.0)
    raw = encode_blocklist_entry(BlocklistEntry(reason="ecc", expires=5.0, released_by="me"))
    assert read_blocklist_entry(raw) == BlocklistEntry(reason="ecc", expires=5.0,
                                                       released_by="me")


def test_a_host_taken_back_follows_the_running_ranks() -> None:
    from trainguard.recovery import groupstore

    grown = groupstore.plan_growth(2, 1, [("node-b", 2)])
    assert (grown.world_size, grown.nodes, grown.joined, grown.grows) == (4, 2, (2, 3), True)
    assert [grown.new_rank(r) for r in (0, 1)] == [0, 1]
    assert "node-b rejoined" in grown.reason
    assert groupstore.Resize.decode(grown.encode()) == grown
    shrunk = groupstore.plan_shrink(4, 2, [2, 3], min_nodes=1, serves_store=False, reason="x")
    assert not isinstance(shrunk, str) and not shrunk.grows
