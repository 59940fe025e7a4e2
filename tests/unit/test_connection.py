"""The one set of NATS connect options the services' bus and the trainer client share."""

from __future__ import annotations

import inspect

import pytest
from nats.aio.client import Client as NATS

from trainguard.core.connection import connect_options


async def _error_cb(exc: Exception) -> None:
    pass


async def _event_cb() -> None:
    pass


@pytest.mark.parametrize(("extra", "added"), [
    ({}, set()),
    ({"pending_size": 65536, "reconnected_cb": _event_cb}, {"pending_size", "reconnected_cb"}),
    ({"disconnected_cb": _event_cb, "pending_size": None}, {"disconnected_cb"}),
])
def test_shared_policy_and_only_what_a_caller_adds(extra: dict[str, object],
                                                   added: set[str]) -> None:
    opts = connect_options("nats://a:1,nats://b:2", name="trainguard-x", connect_timeout=1.5,
                           error_cb=_error_cb, **extra)  # type: ignore[arg-type]
    shared = {"servers", "name", "allow_reconnect", "max_reconnect_attempts",
              "reconnect_time_wait", "ping_interval", "max_outstanding_pings",
              "connect_timeout", "error_cb"}
    assert set(opts) == shared | added
    assert opts["servers"] == ["nats://a:1", "nats://b:2"]
    assert opts["max_reconnect_attempts"] == -1  # reconnect forever: first connect is bounded
    assert (opts["connect_timeout"], opts["error_cb"]) == (1.5, _error_cb)
    for key in added:
        assert opts[key] == extra[key]


def test_every_option_is_one_nats_py_accepts() -> None:
    opts = connect_options("nats://a:1", name="n", connect_timeout=1.0, error_cb=_error_cb,
                           disconnected_cb=_event_cb, reconnected_cb=_event_cb, pending_size=1)
    accepted = set(inspect.signature(NATS.connect).parameters)
    assert set(opts) <= accepted
