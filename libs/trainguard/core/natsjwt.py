"""NATS decentralized auth: nkeys, JWTs (v2 claims) and ``.creds`` files, minted here.

nats-server in operator mode trusts an operator key; the operator signs an account's JWT,
the account signs (with a signing key it lists) each user's JWT, and the server checks a
connecting client's JWT chain and its nonce signature. A user JWT carries the user's
publish/subscribe permissions and an expiry, so one credential can be one rank of one job,
for an hour, without touching the server's configuration.

A JWT is ``b64url(header).b64url(claims).b64url(signature)`` without padding, the header
``{"typ":"JWT","alg":"ed25519-nkey"}``, the signature the issuer nkey's Ed25519 signature
of the first two parts. ``jti`` is the base32 SHA-256 of the claims with an empty ``jti``
(the NATS jwt library's rule). Keys come from ``nkeys`` (the library nats-py signs with).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import nkeys
from nacl.exceptions import BadSignatureError
from nacl.signing import VerifyKey

HEADER: Final = {"typ": "JWT", "alg": "ed25519-nkey"}
CLAIMS_UPDATE: Final = "$SYS.REQ.CLAIMS.UPDATE"
"""nats-server's system-account subject taking an account's updated JWT (full resolver)."""
UNLIMITED: Final = -1

_PREFIXES: Final = {"operator": nkeys.PREFIX_BYTE_OPERATOR,
                    "account": nkeys.PREFIX_BYTE_ACCOUNT, "user": nkeys.PREFIX_BYTE_USER}


@dataclass(frozen=True, slots=True)
class Key:
    """An nkey pair kept as its seed (``S...``); ``public`` is its ``O``/``A``/``U`` key."""

    seed: str

    @staticmethod
    def new(kind: str) -> Key:
        """A fresh random key of ``kind`` (``operator``, ``account`` or ``user``)."""
        return Key(nkeys.encode_seed(os.urandom(32), _PREFIXES[kind]).decode())

    @property
    def public(self) -> str:
        return str(nkeys.from_seed(self.seed.encode()).public_key.decode())

    def sign(self, data: bytes) -> bytes:
        return bytes(nkeys.from_seed(self.seed.encode()).sign(data))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def encode(claims: dict[str, Any], issuer: Key) -> str:
    """``claims`` signed by ``issuer`` (whose public key becomes ``iss``), with ``jti``
    and ``iat`` filled in."""
    body = {**claims, "iss": issuer.public, "iat": claims.get("iat") or int(time.time()),
            "jti": ""}
    digest = hashlib.sha256(json.dumps(body, separators=(",", ":")).encode()).digest()
    body["jti"] = base64.b32encode(digest).decode().rstrip("=")
    head = _b64(json.dumps(HEADER, separators=(",", ":")).encode())
    payload = _b64(json.dumps(body, separators=(",", ":")).encode())
    signing_input = f"{head}.{payload}".encode()
    return f"{head}.{payload}.{_b64(issuer.sign(signing_input))}"


def verified_claims(token: str, issuer: str) -> dict[str, Any]:
    """The claims of ``token`` if ``issuer`` (a public key) signed it and is its ``iss``;
    raises ValueError otherwise."""
    head, _, signature = token.rpartition(".")
    claims = claims_of(token)
    try:  # a public key is base32 of its prefix byte, the Ed25519 key and a CRC16
        raw = base64.b32decode(issuer + "=" * (-len(issuer) % 8))[1:-2]
        if claims.get("iss") != issuer:
            raise ValueError("another issuer")
        VerifyKey(raw).verify(head.encode(), _unb64(signature))
    except (BadSignatureError, ValueError, TypeError):
        raise ValueError(f"not a JWT signed by {issuer}") from None
    return claims


def claims_of(token: str) -> dict[str, Any]:
    """The claims of ``token``, unverified (the server verifies; this reads the expiry)."""
    try:
        out = json.loads(_unb64(token.split(".")[1]))
    except (IndexError, ValueError) as exc:
        raise ValueError(f"not a NATS JWT: {exc}") from None
    if not isinstance(out, dict):
        raise ValueError("not a NATS JWT: claims are not an object")
    return out


def operator_jwt(operator: Key, name: str) -> str:
    """The operator's self-signed JWT, the server's ``operator`` setting."""
    return encode({"sub": operator.public, "name": name,
                   "nats": {"type": "operator", "version": 2}}, operator)


def account_jwt(operator: Key, account: str, name: str, signing_keys: tuple[str, ...] = (),
                *, jetstream: bool = True, revocations: Mapping[str, int] | None = None) -> str:
    """Account ``account`` (public key) signed by ``operator``, with the ``signing_keys``
    that may sign its users (the account's own key stays offline); ``jetstream``: it may
    keep streams (the server's system account may not); ``revocations``: user public key
    -> a Unix time at or before which every JWT issued to that key is refused (and its
    connections ended)."""
    limits: dict[str, Any] = {"subs": UNLIMITED, "data": UNLIMITED, "payload": UNLIMITED,
                              "imports": UNLIMITED, "exports": UNLIMITED, "wildcards": True,
                              "conn": UNLIMITED, "leaf": UNLIMITED}
    if jetstream:
        limits.update(mem_storage=UNLIMITED, disk_storage=UNLIMITED, streams=UNLIMITED,
                      consumer=UNLIMITED)
    nats: dict[str, Any] = {"limits": limits, "signing_keys": list(signing_keys),
                            "default_permissions": {"pub": {}, "sub": {}},
                            "type": "account", "version": 2}
    if revocations:
        nats["revocations"] = dict(sorted(revocations.items()))
    return encode({"sub": account, "name": name, "nats": nats}, operator)


@dataclass(frozen=True, slots=True)
class Permissions:
    """What a user may publish and subscribe to; ``responses``: it may answer requests
    (publish once to a reply subject it was sent)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    responses: bool = False

    @staticmethod
    def from_server_block(block: dict[str, Any]) -> Permissions:
        """From a nats-server ``permissions`` block (``auth.nats_permissions``)."""
        return Permissions(tuple(block["publish"]["allow"]), tuple(block["subscribe"]["allow"]),
                           bool(block.get("allow_responses")))


def user_jwt(signer: Key, account: str, user: str, name: str, permissions: Permissions,
             expires: float | None = None) -> str:
    """User ``user`` (public key) of ``account``, signed by the account's signing key
    ``signer``; ``expires``: a Unix time after which the server refuses it (and
    disconnects it, if connected)."""
    nats: dict[str, Any] = {"pub": {"allow": list(permissions.publish)},
                            "sub": {"allow": list(permissions.subscribe)},
                            "subs": UNLIMITED, "data": UNLIMITED, "payload": UNLIMITED,
                            "type": "user", "version": 2}
    if signer.public != account:  # signed by a signing key the account lists
        nats["issuer_account"] = account
    if permissions.responses:
        nats["resp"] = {"max": 1, "ttl": 0}
    claims: dict[str, Any] = {"sub": user, "name": name, "nats": nats}
    if expires is not None:
        claims["exp"] = int(expires)
    return encode(claims, signer)


def creds(token: str, seed: str) -> str:
    """A ``.creds`` file: the user's JWT and its nkey seed, as ``nsc`` writes it (a
    client reads it again on every reconnect: :class:`.credsfile.CredsFile`)."""
    return ("-----BEGIN NATS USER JWT-----\n"
            f"{token}\n"
            "------END NATS USER JWT------\n\n"
            "************************* IMPORTANT *************************\n"
            "NKEY Seed printed below can be used to sign and prove identity.\n"
            "NKEYs are sensitive and should be treated as secrets.\n\n"
            "-----BEGIN USER NKEY SEED-----\n"
            f"{seed}\n"
            "------END USER NKEY SEED------\n\n"
            "*************************************************************\n")


def jwt_of_creds(text: str) -> str:
    """The JWT in a ``.creds`` file's text (for its claims: expiry, inbox)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("-----BEGIN NATS USER JWT") and i + 1 < len(lines):
            return lines[i + 1].strip()
    raise ValueError("no user JWT in this creds file")


INBOX_ROOT: Final = "_INBOX"
"""The root of reply inboxes; a rank's or an agent's credential confines it below."""


def inbox_of(creds_text: str) -> str | None:
    """The reply-inbox prefix a credential confines its holder to (``_INBOX.J.rR``), or
    None where it may use any (``_INBOX.>``)."""
    allowed = claims_of(jwt_of_creds(creds_text)).get("nats", {}).get("sub", {}).get(
        "allow", [])
    for pattern in allowed:
        if pattern == f"{INBOX_ROOT}.>":
            return None
    for pattern in allowed:
        if pattern.startswith(f"{INBOX_ROOT}.") and pattern.endswith(".>"):
            return str(pattern[:-2])
    return None
