from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from trainguard.contract.envnames import CHECKPOINT_ROOT, PREFIX, setting
from trainguard.contract.errors import ConfigError
from trainguard.runtime.config import Settings, load_settings
from trainguard.services.checkpointer.settings import CheckpointerSettings
from trainguard.services.detector.settings import DetectorSettings
from trainguard.services.diagnoser.settings import DiagnoserSettings


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


def test_log_format_is_a_setting_and_only_text_or_json() -> None:
    assert load_settings(Settings, env={}).log_format == "text"
    assert load_settings(Settings, env={"TRAINGUARD_LOG_FORMAT": "json"}).log_format == "json"
    with pytest.raises(ConfigError, match="log_format='xml': use one of text, json"):
        load_settings(Settings, env={"TRAINGUARD_LOG_FORMAT": "xml"})


@pytest.mark.parametrize(("cls", "field", "raw", "value"), [
    (Settings, "connect_timeout", "7.5", 7.5),
    (CheckpointerSettings, "retain", "9", 9),
    (DetectorSettings, "lease_ttl", "4", 4.0),
    (DiagnoserSettings, "symptom_window", "33", 33.0),
])
def test_every_settings_class_reads_the_one_prefix(cls: type[Settings], field: str, raw: str,
                                                   value: object) -> None:
    """Each settings class reads ``envnames.setting(field)``: ``TRAINGUARD_<FIELD>``."""
    assert setting(field) == PREFIX + field.upper() and PREFIX == "TRAINGUARD_"
    assert getattr(load_settings(cls, env={}), field) != value
    assert getattr(load_settings(cls, env={setting(field): raw}), field) == value


def test_one_checkpoint_root_variable_for_ranks_and_coordinator(tmp_path: Path) -> None:
    env = {CHECKPOINT_ROOT: str(tmp_path)}
    assert load_settings(CheckpointerSettings, env=env).checkpoint_root == str(tmp_path)
    with pytest.raises(ConfigError, match="unknown setting 'ckpt_root'"):
        load_settings(CheckpointerSettings, env={}, overrides={"ckpt_root": str(tmp_path)})
