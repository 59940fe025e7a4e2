"""Sentinel URLs: what they name, and the clear errors of malformed ones."""

from __future__ import annotations

import pytest

from trainguard.contract.errors import ConfigError
from trainguard.runtime.config import Settings, load_settings
from trainguard.runtime.redisurl import SentinelTarget, parse_sentinel_url


def test_a_sentinel_url_names_sentinels_master_db_and_the_sentinels_credentials() -> None:
    url = "rediss+sentinel://sen:p%40ss@10.0.0.1:26380,sentinel-b,10.0.0.3:26379/tg-main/2"
    assert parse_sentinel_url(url) == SentinelTarget(
        sentinels=(("10.0.0.1", 26380), ("sentinel-b", 26379), ("10.0.0.3", 26379)),
        master="tg-main", db=2, tls=True, username="sen", password="p@ss")
    plain = parse_sentinel_url("redis+sentinel://127.0.0.1:26379/tg")
    assert (plain.tls, plain.db, plain.username, plain.password) == (False, 0, None, None)


@pytest.mark.parametrize(("url", "why"), [
    ("redis+sentinel://127.0.0.1:26379", "no master name"),
    ("redis+sentinel://127.0.0.1:x/tg", "port that is not a number"),
    ("redis+sentinel://,127.0.0.1/tg", "has no host"),
    ("redis+sentinel://127.0.0.1/tg/zero", "database 'zero' is not a number"),
])
def test_malformed_sentinel_urls_say_what_is_wrong_and_the_syntax(url: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why) as err:
        parse_sentinel_url(url)
    assert "expected redis+sentinel://" in str(err.value)


def test_settings_take_sentinel_urls_and_bound_the_replicas() -> None:
    url = "redis+sentinel://a:26379,b:26379,c:26379/tg"
    assert load_settings(Settings, env={"TRAINGUARD_REDIS_URL": url}).redis_url == url
    with pytest.raises(ConfigError, match="no master name"):
        load_settings(Settings, env={"TRAINGUARD_REDIS_URL": "redis+sentinel://a:26379"})
    settings = load_settings(Settings, env={"TRAINGUARD_STREAM_REPLICAS": "3"})
    assert settings.stream_replicas == 3
    with pytest.raises(ConfigError, match="stream_replicas=7"):
        load_settings(Settings, env={"TRAINGUARD_STREAM_REPLICAS": "7"})
