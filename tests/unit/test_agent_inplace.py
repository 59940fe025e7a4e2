"""The agent's in-place rule (:mod:`services.agent.inplace`): one failed rank of a group
whose every rank declared in-place recovery is replaced alone; anything else restarts the
group cold, and the reason says why."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from trainguard.recovery import groupstore
from trainguard.recovery.path import InPlaceKeys, decide, read_keys, resize_blocker

OK: dict[str, Any] = {"enabled": True, "failed": [2], "initiated": [], "restarts_left": 5,
                      "generation": 4, "keys": InPlaceKeys([], {})}


@pytest.mark.parametrize(("change", "in_place", "said"), [
    ({}, True, ""),
    ({"enabled": False}, False, "--no-in-place"),
    ({"initiated": [2]}, False, "stopped by a command"),
    ({"failed": [1, 2]}, False, "2 ranks failed at once (1, 2)"),
    ({"restarts_left": 0}, False, "no restarts left"),
    ({"generation": None}, False, "does not answer"),
    ({"keys": None}, False, "cannot be read"),
    ({"keys": InPlaceKeys([0, 3], {})}, False, "rank(s) 0, 3 did not declare in-place recovery in "
                                 "generation 4"),
    ({"failed": list(range(20))}, False, "0, 1, 2, 3, 4, 5, 6, 7 and 12 more"),
])
def test_in_place_or_why_not(change: dict[str, Any], in_place: bool, said: str) -> None:
    d = decide(**{**OK, **change})
    assert d.in_place is in_place
    assert said in d.reason if said else d.reason == ""


def job_store(declared: dict[int, str]) -> Any:
    """A real TCPStore (as the agent's job store is) holding these ranks' in-place keys."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for rank, value in declared.items():
        store.set(groupstore.in_place_key(7, rank), value)
    return store


def missing(store: Any, generation: int, world: int) -> list[int]:
    keys = read_keys(store, generation, world)
    assert keys is not None
    return keys.missing


def test_the_keys_name_the_ranks_that_did_not_declare() -> None:
    store = job_store({0: "1", 1: "1", 3: "1"})
    assert missing(store, 7, 4) == [2]
    assert missing(store, 8, 2) == [0, 1]
    every = job_store({r: "1" for r in range(4)})
    assert missing(every, 7, 4) == []


class Gone:
    """A store whose host left: every call raises, as a TCPStore client's does then."""

    def check(self, keys: list[str]) -> bool:
        raise RuntimeError("Connection reset by peer")


def test_a_store_that_is_gone_reads_as_unknown() -> None:
    assert read_keys(Gone(), 7, 4) is None


FSDP4 = {r: f"sharded 1 shard={r}" for r in range(4)}
HSDP4 = {r: f"hybrid 2 shard={r % 2}" for r in range(4)}


@pytest.mark.parametrize(("declared", "in_place", "said"), [
    ({r: "1" for r in range(4)}, True, ""),                       # an older rank: replicated
    ({r: "replicated 4 dp" for r in range(4)}, True, ""),
    (FSDP4, False, "no other rank holds rank 2's state (sharded, shard shard=2)"),
    (HSDP4, False, "also held by rank(s) 0), but rank(s) 0, 1, 2, 3 cannot rebuild"),
    ({r: f"{d} rebuilds" for r, d in HSDP4.items()}, True, ""),     # trainguard.torch.fsdp
    ({**{r: f"{d} rebuilds" for r, d in HSDP4.items()}, 1: HSDP4[1]}, False,
     "but rank(s) 1 cannot rebuild"),
    ({r: f"sharded 1 shard={r} rebuilds" for r in range(4)}, False, "no other rank holds"),
    # FSDP with buddy copies: kept in memory on another host, rebuilt in place.
    ({r: f"sharded 1 shard={r} kept" for r in range(4)}, True, ""),
    ({**{r: f"sharded 1 shard={r} kept" for r in range(4)}, 0: "sharded 1 shard=0"},
     False, "shard shard=2, kept in memory on another host), but rank(s) 0 cannot rebuild"),
    ({**{r: "1" for r in range(4)}, 2: "garbage"}, False, "no other rank holds rank 2's"),
])
def test_a_replacement_goes_in_place_only_where_a_peer_holds_its_state(
        declared: dict[int, str], in_place: bool, said: str) -> None:
    keys = read_keys(job_store(declared), 7, 4)
    assert keys is not None and keys.missing == []
    d = decide(**{**OK, "generation": 7, "keys": keys})
    assert d.in_place is in_place
    assert said in d.reason if said else d.reason == ""


HSDP4_REBUILT = {r: f"{d} rebuilds" for r, d in HSDP4.items()}


@pytest.mark.parametrize(("declared", "leaving", "why"), [
    ({r: "replicated 4 dp" for r in range(4)}, [2, 3], None),
    ({0: "1", 1: "1", 3: "1"}, [2], "rank(s) 2 did not declare"),
    (FSDP4, [], "sharded with no replica: a resize in place would reshard every parameter"),
    (HSDP4, [2, 3], "rank(s) 0, 1, 2, 3 cannot rebuild their sharded model on a new group"),
    ({**HSDP4_REBUILT, 1: HSDP4[1]}, [], "rank(s) 1 cannot rebuild"),
    (HSDP4_REBUILT, [2, 3], None),  # one replica leaves: every shard keeps a holder
    (HSDP4_REBUILT, [0, 1], None),
    (HSDP4_REBUILT, [], None),  # a host taken back: its ranks take their shards
    (HSDP4_REBUILT, [1, 3], "no rank that stays holds the shard(s) shard=1"),
    ({r: f"hybrid 2 shard={r // 2} rebuilds" for r in range(4)}, [2, 3],
     "no rank that stays holds the shard(s) shard=1"),  # the host held a whole shard
    # HSDP down to one replica: it may grow again, not lose a host.
    ({r: f"sharded 1 shard={r} rebuilds" for r in range(2)}, [], None),
    # FSDP kept on buddies is replaced in place, never resized (it would reshard).
    ({r: f"sharded 1 shard={r} kept" for r in range(4)}, [], "sharded with no replica"),
    ({r: f"sharded 1 shard={r} rebuilds" for r in range(2)}, [1],
     "no rank that stays holds the shard(s) shard=1"),
])
def test_resizing_in_place_needs_every_rank_and_every_shard_kept(
        declared: dict[int, str], leaving: list[int], why: str | None) -> None:
    blocker = resize_blocker(read_keys(job_store(declared), 7, len(declared)), leaving)
    assert blocker is None if why is None else why in (blocker or ""), blocker
    assert resize_blocker(None) == "the in-place keys cannot be read"


# -- shrinking in place: the pure rule ------------------------------------------------------

@pytest.mark.parametrize(("world", "nodes", "leaving", "min_nodes", "store", "why"), [
    (4, 2, [], 1, False, "runs no rank"),
    (4, 2, [0, 1], 1, True, "serves the job store"),
    (4, 2, [2, 3], 2, False, "below --nnodes minimum 2"),
    (4, 2, [4], 1, False, "not in the group of 4"),
    (4, 2, [3], 1, False, None),
    (4, 2, [2, 3], 1, False, None),
    (2, 2, [0, 1], 1, False, "no rank would be left"),
])
def test_only_the_highest_ranks_of_a_host_that_does_not_hold_the_store_leave_in_place(
        world: int, nodes: int, leaving: list[int], min_nodes: int, store: bool,
        why: str | None) -> None:
    got = groupstore.plan_shrink(world, nodes, leaving, min_nodes=min_nodes,
                                 serves_store=store, reason="isolated")
    if why is None:
        kept = tuple(r for r in range(world) if r not in leaving)
        assert got == groupstore.Resize(world_size=world - len(leaving), nodes=nodes - 1,
                                        left=tuple(sorted(leaving)), reason="isolated",
                                        kept=kept)
    else:
        assert isinstance(got, str) and why in got, got


def test_a_middle_host_leaving_closes_up_the_gap() -> None:
    """Six ranks on three hosts, the middle one leaves: ranks 4-5 become 2-3, 0-1 stay."""
    got = groupstore.plan_shrink(6, 3, [2, 3], min_nodes=1, serves_store=False, reason="x")
    assert isinstance(got, groupstore.Resize)
    assert (got.world_size, got.nodes, got.kept) == (4, 2, (0, 1, 4, 5))
    assert [got.new_rank(r) for r in range(6)] == [0, 1, None, None, 2, 3]


def test_a_resize_record_round_trips_and_a_bad_one_is_refused() -> None:
    r = groupstore.Resize(world_size=2, nodes=1, left=(2, 3), reason="host node-b left",
                          kept=(0, 1))
    assert groupstore.Resize.decode(r.encode().encode()) == r
    for bad in (b"", b"{}", b'{"world_size": "x", "nodes": 1, "left": []}', b"[1]",
                b'{"world_size": 3, "nodes": 1, "left": [], "kept": [0, 1]}'):
        with pytest.raises(ValueError, match="unreadable resize record"):
            groupstore.Resize.decode(bad)


def test_resize_records_of_a_store_that_went_away_are_unknown_not_none() -> None:
    """Only a store that answered says "no record": a lost one must be read again."""

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    from trainguard.runtime.embedded import free_port

    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=2))
    client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2))
    resize = groupstore.Resize(world_size=2, nodes=1, left=(2, 3), reason="x", kept=(0, 1))
    client.set(groupstore.resize_key(5), resize.encode())
    assert groupstore.read_resizes(client, 3, 6) == [(5, resize)]
    del server
    assert groupstore.read_resizes(client, 3, 6) is None
