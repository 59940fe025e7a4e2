"""A ``.creds`` file as nats-py's ``signature_cb`` and ``user_jwt_cb``: its own module, so
that reading a process's settings (:mod:`.auth`) loads no nkeys or PyNaCl (a disabled Guard
loads none)."""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from typing import Any

import nkeys
from nacl.signing import SigningKey

JWT_START = b"-----BEGIN NATS USER JWT-----"
SEED_START = b"-----BEGIN USER NKEY SEED-----"


def _line_after(text: bytes, marker: bytes) -> bytes:
    """The line that follows ``marker`` in a ``.creds`` file's ``text``."""
    at = text.find(marker)
    start = text.find(b"\n", at) if at >= 0 else -1
    if start < 0:
        raise ValueError(f"no line after {marker.decode()!r} in this creds file")
    end = text.find(b"\n", start + 1)
    return text[start + 1:end if end >= 0 else None].strip()


def _seed_of(encoded: bytes) -> bytes:
    """The 32-byte Ed25519 seed of an nkey seed (``SU...``: base32 of two prefix bytes, the
    seed and a CRC16), checked as nkeys checks it; raises ValueError."""
    try:
        raw = base64.b32decode(encoded + b"=" * (-len(encoded) % 8))
    except binascii.Error:
        raw = b""
    if len(raw) != 36 or raw[0] & 0xF8 != nkeys.PREFIX_BYTE_SEED:
        raise ValueError("the creds file's seed is not an nkey seed (S...)")
    return raw[2:34]


class CredsFile:
    """A ``.creds`` file read whole once at every connect and reconnect (a renewed file is
    used from the next one on), its JWT and nonce signature taken from that one reading.

    Why not nats-py's ``user_credentials``: given a path it reads the seed unbuffered, one
    system call per byte (about 1 ms a connect); given the text (``RawCredentials``) it
    would keep the seed for the process's life; and either way it reads the file (or the
    text) once for the JWT and once more for the seed, so a renewal between the two would
    pair one credential's JWT with another's signature. The seed is decoded for the one
    signature and dropped."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._jwt: bytes | None = None  # from the reading that signed this connect's nonce

    def sign(self, nonce: str) -> bytes:
        """nats-py's ``signature_cb``: the server's nonce signed with the file's seed."""
        with open(self.path, "rb") as f:
            text = f.read()
        self._jwt = _line_after(text, JWT_START)
        # The key lives for this one signature (nkeys' KeyPair would add only overhead).
        signed = SigningKey(_seed_of(_line_after(text, SEED_START))).sign(nonce.encode())
        return base64.b64encode(signed.signature)

    def user_jwt(self) -> bytes:
        """nats-py's ``user_jwt_cb``: the JWT of the reading that ``sign`` just made (nats-py
        calls the two back to back, nothing awaited between)."""
        jwt, self._jwt = self._jwt, None
        return jwt if jwt is not None else _line_after(Path(self.path).read_bytes(), JWT_START)

    def options(self) -> dict[str, Any]:
        """nats-py ``connect`` options that authenticate with this file."""
        return {"signature_cb": self.sign, "user_jwt_cb": self.user_jwt}

