from __future__ import annotations

import dataclasses

import pytest

from trainguard.config import Settings, load_settings
from trainguard.errors import ConfigError


def test_defaults_work_with_the_embedded_control_plane() -> None:
    s = load_settings(Settings, env={})
    assert s.nats_url == "nats://127.0.0.1:4222"
    assert s.redis_url == "redis://127.0.0.1:6379/0"
    assert s.subjects.hb("j", 0) == "tg.j.hb.0"
    assert s.redis_key("progress", "j") == "tg:progress:j"


def test_env_then_overrides_win() -> None:
    env = {"TRAINGUARD_PREFIX": "prod", "TRAINGUARD_MAX_DELIVER": "9",
           "TRAINGUARD_NATS_URL": "nats://10.0.0.1:4222"}
    s = load_settings(Settings, env=env, overrides={"max_deliver": 3, "prefix": None})
    assert (s.prefix, s.max_deliver, s.nats_url) == ("prod", 3, "nats://10.0.0.1:4222")


def test_settings_are_frozen() -> None:
    s = load_settings(Settings, env={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.prefix = "x"  # type: ignore[misc]


@pytest.mark.parametrize(("overrides", "match"), [
    ({"max_delivr": 3}, "unknown setting 'max_delivr'"),
    ({"max_deliver": "lots"}, "max_deliver='lots' is not a valid int"),
    ({"nats_url": "localhost:4222"}, "nats_url='localhost:4222' is not a valid URL"),
    ({"redis_url": "http://x"}, "redis_url"),
    ({"prefix": "a b"}, "invalid subject prefix"),
])
def test_bad_settings_say_what_is_wrong(overrides: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_settings(Settings, env={}, overrides=overrides)


def test_bad_env_value_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="TRAINGUARD_CONNECT_TIMEOUT"):
        load_settings(Settings, env={"TRAINGUARD_CONNECT_TIMEOUT": "soon"})
