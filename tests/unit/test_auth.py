"""The role tables: who may publish commands, answer endpoints and touch which keys."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from trainguard.contract.errors import ConfigError
from trainguard.core.auth import (
    ROLES,
    Role,
    generate,
    load_credentials,
    nats_authorization_template,
    nats_permissions,
    redis_acl,
    write_credentials,
)

ROOT = Path(__file__).resolve().parents[2]


def _publishes(role: Role, subject_pattern: str) -> bool:
    return subject_pattern in nats_permissions(role)["publish"]["allow"]


@pytest.mark.parametrize("role", ROLES)
def test_only_the_control_plane_and_operators_publish_commands(role: Role) -> None:
    allowed = nats_permissions(role)["publish"]["allow"]
    commands = any(".cmd." in p or p.endswith(".cmd.>") for p in allowed)
    assert commands == (role in ("remediator", "checkpointer", "operator"))


@pytest.mark.parametrize("role", ROLES)
def test_only_the_coordinator_answers_endpoints(role: Role) -> None:
    perms = nats_permissions(role)
    serves = "tg.>" in perms["subscribe"]["allow"] and perms.get("allow_responses", False)
    assert bool(serves) == (role == "checkpointer")


def test_ranks_publish_their_own_subjects_and_ask_only_for_the_resume_point() -> None:
    assert _publishes("rank", "tg.*.hb.*") and _publishes("rank", "tg.*.rpc.resume")
    assert not _publishes("rank", "tg.*.rpc.rollback")
    assert not any(p.startswith("$JS.API") for p in nats_permissions("rank")["publish"]["allow"])


def test_a_job_narrows_ranks_and_agents_only() -> None:
    assert nats_permissions("rank", job="j1")["subscribe"]["allow"] == [
        "_INBOX.>", "tg.j1.cmd.all", "tg.j1.cmd.rank.*"]
    assert "tg.*.cmd.>" in nats_permissions("remediator", job="j1")["publish"]["allow"]


def test_redis_users() -> None:
    assert redis_acl("rank", "pw") is None
    agent = redis_acl("agent", "pw")
    assert agent is not None
    grants = agent.split()
    # Read only (Redis 6.2 has no per-key command rules: any write would reach every key).
    assert {"+ping", "+get", "+hget"} <= set(grants)
    assert not {"+set", "+del", "+hset", "+hdel", "+expire", "+@write", "+@all"} & set(grants)
    keys = {g for g in grants if g.startswith("~")}
    assert keys == {"~tg:blocklist"}  # node records are the control plane's; epochs NATS's
    oncall = redis_acl("oncall", "pw")
    assert oncall is not None and "+@read" in oncall and "+@all" not in oncall


def test_the_shipped_nats_config_is_the_rendered_table() -> None:
    shipped = (ROOT / "deploy" / "nats-auth.conf").read_text()
    assert shipped == nats_authorization_template(), (
        "deploy/nats-auth.conf is stale: regenerate it with "
        "`trainguard credentials --template > deploy/nats-auth.conf`")


def test_credentials_files_are_private_and_round_trip(tmp_path: Path) -> None:
    creds = generate()
    paths = write_credentials(tmp_path, creds)
    for role, path in paths.items():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert load_credentials(path) == creds[role]
    assert creds["rank"].redis is None and creds["agent"].redis is not None
    assert len({c.nats.password for c in creds.values() if c.nats}) == len(ROLES)


def test_a_bad_credentials_file_names_itself(tmp_path: Path) -> None:
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"role": "wizard"}))
    with pytest.raises(ConfigError, match=r"x\.json"):
        load_credentials(bad)
    with pytest.raises(ConfigError, match="trainguard credentials"):
        load_credentials(tmp_path / "missing.json")


@pytest.mark.parametrize("role", ROLES)
def test_only_services_touch_streams_or_delete_consumers(role: Role) -> None:
    allowed = nats_permissions(role)["publish"]["allow"]
    service = role in ("detector", "diagnoser", "remediator", "checkpointer", "service")
    assert ("$JS.API.>" in allowed) == service
    if not service:
        assert not [p for p in allowed if ".STREAM.CREATE" in p or ".STREAM.UPDATE" in p
                    or ".DELETE" in p or ".PURGE" in p]


def test_agents_reach_only_the_command_stream_and_readers_only_events() -> None:
    agent = nats_permissions("agent")["publish"]["allow"]
    consumer_apis = [p for p in agent if p.startswith(("$JS.API.CONSUMER", "$JS.ACK"))]
    assert consumer_apis and all(".TG_CMDS" in p for p in consumer_apis)
    assert "tg.*.dead" in agent  # it dead-letters what it cannot read
    for role in ("oncall", "operator"):
        allowed = nats_permissions(role)["publish"]["allow"]
        consumer_apis = [p for p in allowed if p.startswith("$JS.API.CONSUMER")]
        assert all(".TG_EVENTS" in p or ".TG_DEAD" in p for p in consumer_apis), role
        assert "$JS.FC.>" in allowed  # ordered consumers answer flow control
        assert not [p for p in allowed if "MSG.NEXT" in p or p.startswith("$JS.ACK")]


def test_a_secret_never_goes_through_a_planted_symlink(tmp_path: Path) -> None:
    from trainguard.core.auth import write_private

    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("keep")
    (tmp_path / "agent.json").symlink_to(elsewhere)
    write_private(tmp_path / "agent.json", "secret")
    assert elsewhere.read_text() == "keep"  # the link was replaced, not followed
    assert not (tmp_path / "agent.json").is_symlink()
    assert stat.S_IMODE((tmp_path / "agent.json").stat().st_mode) == 0o600
