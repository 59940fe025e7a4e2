"""The JWT encoder and the identities' permissions (the server's verdict is in
tests/integration/test_identities.py)."""

from __future__ import annotations

import base64
import hashlib
import json
import time

import nkeys
import pytest

from trainguard.contract.rpc import RankCredentialsRequest
from trainguard.core.auth import access_from
from trainguard.core.credsfile import CredsFile
from trainguard.core.identities import (
    Trust,
    agent_permissions,
    ensure_issuer_creds,
    ensure_role_creds,
    issuer_permissions,
    rank_permissions,
)
from trainguard.core.natsjwt import Key, Permissions, claims_of, encode, inbox_of, jwt_of_creds


def _part(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def test_a_jwt_is_signed_by_its_issuer_with_the_nats_header_and_jti() -> None:
    issuer = Key.new("account")
    token = encode({"sub": "UX", "nats": {"type": "user", "version": 2}}, issuer)
    head, body, sig = token.split(".")
    assert "=" not in token
    assert json.loads(_part(head)) == {"typ": "JWT", "alg": "ed25519-nkey"}
    claims = json.loads(_part(body))
    assert claims["iss"] == issuer.public and claims["iss"].startswith("A")
    unsigned = json.dumps({**claims, "jti": ""}, separators=(",", ":")).encode()
    assert claims["jti"] == base64.b32encode(hashlib.sha256(unsigned).digest()).decode().rstrip("=")
    verifier = nkeys.from_seed(issuer.seed.encode())
    assert verifier.verify(f"{head}.{body}".encode(), _part(sig))


def test_a_rank_may_name_only_its_own_subjects_and_inbox(tmp_path) -> None:
    p = rank_permissions("tg", "j", 3)
    assert "tg.j.step.3" in p.publish and not any(s.endswith("*") for s in p.publish
                                                  if ".ack." not in s)
    assert set(p.subscribe) == {"tg.j.cmd.all", "tg.j.cmd.rank.3", "_INBOX.j.r3.>"}
    text = Trust.new().minter.mint_rank("tg", "j", 3, ttl=60)
    assert claims_of(jwt_of_creds(text))["nats"]["sub"]["allow"] == list(p.subscribe)
    assert inbox_of(text) == "_INBOX.j.r3"
    path = tmp_path / "rank.creds"
    path.write_text(text)
    options = access_from(str(path)).nats_options()  # a .creds file as the credentials
    assert options["user_jwt_cb"].__self__.path == str(path)
    assert options["user_jwt_cb"]().decode() == jwt_of_creds(text)  # no nonce signed yet
    assert options["inbox_prefix"] == "_INBOX.j.r3"


def test_a_creds_file_signs_each_nonce_with_the_key_of_the_jwt_it_then_presents(
        tmp_path) -> None:
    minter = Trust.new().minter
    path = tmp_path / "rank.creds"
    options = CredsFile(str(path)).options()
    for rank in (3, 4):  # a renewal rewrites the file: the next connect uses the new one
        path.write_text(minter.mint_rank("tg", "j", rank, ttl=60))
        sig = base64.b64decode(options["signature_cb"]("a-nonce"))
        token = options["user_jwt_cb"]().decode()
        assert token == jwt_of_creds(path.read_text())
        seed = path.read_text().split("NKEY SEED-----\n")[1].split("\n")[0]
        user = nkeys.from_seed(seed.encode())
        assert user.public_key.decode() == claims_of(token)["sub"]
        assert user.verify(b"a-nonce", sig)
    # A user's public key where its seed should be is refused, not signed with.
    text = path.read_text()
    seed = text.split("NKEY SEED-----\n")[1].split("\n")[0]
    path.write_text(text.replace(seed, claims_of(jwt_of_creds(text))["sub"]))
    with pytest.raises(ValueError, match="not an nkey seed"):
        options["signature_cb"]("a-nonce")


def test_an_agent_may_use_only_its_own_durable() -> None:
    p = agent_permissions("tg", "j", "h1")
    api = [s for s in p.publish if s.startswith("$JS.API.CONSUMER")]
    assert api and all(".agent-j-h1" in s for s in api)
    assert not any("CREATE" in s for s in api)  # the control plane creates it
    assert "tg.j.rpc.consumer.h1" in p.publish and "tg.j.rpc.creds.h1" in p.publish
    assert "$JS.ACK.TG_CMDS.agent-j-h1.>" in p.publish
    assert "tg.j.cmd.host.h1" in p.subscribe and "tg.j.cmd.host.*" not in p.subscribe


def test_role_credentials_are_kept_and_reminted_only_for_a_new_trust(tmp_path) -> None:
    first, second = Trust.new(), Trust.new()
    paths = ensure_role_creds(tmp_path, first, "tg")
    assert "rank" not in paths and "agent" not in paths  # theirs are per identity
    kept = paths["detector"].read_text()
    assert ensure_role_creds(tmp_path, first, "tg")["detector"].read_text() == kept
    renewed = ensure_role_creds(tmp_path, second, "tg")["detector"].read_text()
    assert claims_of(jwt_of_creds(renewed))["iss"] == second.signer.public


def test_the_issuers_credential_is_reminted_when_its_permissions_changed(tmp_path) -> None:
    trust = Trust.new()
    path = tmp_path / "issuer.creds"
    path.write_text(trust.minter.mint("issuer", Permissions(("tg.*.dead",),
                                                            ("tg.*.rpc.creds",))))
    ensure_issuer_creds(tmp_path, trust, "tg")
    allowed = claims_of(jwt_of_creds(path.read_text()))["nats"]
    assert allowed["pub"]["allow"] == list(issuer_permissions("tg").publish)
    assert allowed["sub"]["allow"] == list(issuer_permissions("tg").subscribe)
    kept = path.read_text()
    assert ensure_issuer_creds(tmp_path, trust, "tg").read_text() == kept


def test_revocations_are_kept_beside_the_trust_until_their_credentials_expire(
        tmp_path) -> None:
    trust = Trust.ensure(tmp_path / "trust")
    gone, never = Key.new("user").public, Key.new("user").public
    assert trust.revocations.add({gone: 1_000.0, never: None}, now=500.0) == {
        gone: 500, never: 500}
    nats = claims_of(trust.account_jwt(now=600.0))["nats"]
    assert nats["revocations"] == {gone: 500, never: 500}
    assert nats["signing_keys"] == [trust.signer.public]
    # Past its credential's expiry an entry is dropped (the server refuses it anyway).
    assert Trust.ensure(tmp_path / "trust").revocations.current(now=2_000.0) == {never: 500}


def _rank_jwt(trust: Trust, key: str) -> str:
    req = RankCredentialsRequest(host="h1", keys={3: key})
    return trust.minter.issue("tg", "j", "h1", req, ttl=60, limit=8).jwts[3]


def test_a_replaced_credential_must_be_this_hosts_rank_and_signed_here() -> None:
    trust, other = Trust.new(), Trust.new()
    key = Key.new("user").public
    mine = _rank_jwt(trust, key)
    assert trust.minter.replaced("j", "h1", RankCredentialsRequest(
        host="h1", keys={}, replaces=[mine])) == {key: pytest.approx(time.time() + 60, abs=5)}
    for job, host, token in (("j", "h2", mine), ("k", "h1", mine),
                             ("j", "h1", _rank_jwt(other, key))):
        req = RankCredentialsRequest(host=host, keys={0: Key.new("user").public},
                                     replaces=[token])
        reply = trust.minter.issue("tg", job, host, req, ttl=60, limit=8)
        assert not reply.ok and ("not a rank credential" in reply.reason
                                 or "not a JWT signed by" in reply.reason)
