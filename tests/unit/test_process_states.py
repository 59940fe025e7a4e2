"""Process states: one vocabulary from the agent's /proc read to the detector and progress."""

from __future__ import annotations

import os
import subprocess
import sys

import msgspec
import pytest

from trainguard.agent import procs
from trainguard.contract.codec import decode_telemetry, encode_telemetry
from trainguard.contract.errors import DecodeError
from trainguard.contract.schemas import NodeHeartbeat, is_gone, is_stopped
from trainguard.runtime.state import Progress, RankProgress, decode_progress, encode_progress

STATES = [
    # letter, stopped (cannot progress, ignores SIGTERM), gone
    ("R", False, False), ("S", False, False), ("I", False, False), ("P", False, False),
    ("T", True, False), ("t", True, False), ("D", True, False),
    ("Z", False, True), ("X", False, True), ("x", False, True),
    (None, False, False),
]


@pytest.mark.parametrize(("letter", "stopped", "gone"), STATES,
                         ids=[str(s[0]) for s in STATES])
def test_what_each_state_means(letter: str | None, stopped: bool, gone: bool) -> None:
    assert (is_stopped(letter), is_gone(letter)) == (stopped, gone)


def test_the_agent_reads_its_own_and_a_dead_process() -> None:
    assert procs.state_of(os.getpid()) in ("R", "S")
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert procs.state_of(child.pid) == "X" and not procs.alive(child.pid)


def test_states_travel_in_node_heartbeats_and_progress() -> None:
    beat = NodeHeartbeat(job="j", time=1.0, host="h", ranks={0: "R", 1: "T", 2: "D"})
    assert decode_telemetry(encode_telemetry(beat)) == beat
    progress = Progress(job="j", time=1.0, ranks={1: RankProgress(rank=1, process_state="T",
                                                                  state="stopped")})
    assert decode_progress(encode_progress(progress)).ranks[1].process_state == "T"


def test_a_letter_no_kernel_uses_is_rejected_on_the_wire() -> None:
    data = msgspec.msgpack.encode({"t": "node.v1", "job": "j", "time": 1.0, "host": "h",
                                   "ranks": {0: "Q"}})
    with pytest.raises(DecodeError, match="ranks"):
        decode_telemetry(data)


def test_which_changes_are_beaten_about_at_once() -> None:
    assert procs.notable_change({0: "S"}, {0: "T"})  # frozen
    assert procs.notable_change({0: "T"}, {0: "R"})  # thawed
    assert procs.notable_change({0: "R"}, {0: "X"})  # gone
    assert not procs.notable_change({0: "R"}, {0: "R", 1: "S"})  # a rank came
    assert not procs.notable_change({2: "S"}, {1: "S"})  # renumbered in place
    assert not procs.notable_change({0: "R", 1: "S"}, {0: "S", 1: "R"})
    assert not procs.notable_change({0: "R"}, {0: "D"})  # brief: the regular beat says it
    assert not procs.notable_change({0: "S"}, {0: "t"})
    assert not procs.notable_change({0: "Z"}, {0: "X"})  # gone either way


@pytest.mark.parametrize("name", ["node_interval", "state_interval", "gpu_interval",
                                  "gpu_look_interval"])
def test_an_agent_interval_that_is_not_positive_names_itself(name: str) -> None:
    from trainguard.agent.settings import AgentSettings
    from trainguard.contract.errors import ConfigError
    from trainguard.runtime.config import load_settings

    with pytest.raises(ConfigError, match=f"{name}=0"):
        load_settings(AgentSettings, env={}, overrides={name: 0})
