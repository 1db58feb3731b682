"""The handshake: an HMAC-SHA256 challenge-response on the run secret, both ways.

The master sends a random nonce, the group answers with ``HMAC(secret, "hello" | nonces | its identity)``,
the master answers with ``HMAC(secret, "welcome" | nonces)``. Nonces are fresh per connection, so a
recorded handshake cannot be replayed. Frames before authentication are limited to ``PREAUTH_MAX_FRAME``,
the WELCOME included: the group checks its MAC before it accepts anything larger.

Then both ends derive this connection's session keys from the secret and both nonces
(:mod:`worker.protocol.session`) and every later frame carries a sequence number and a MAC.
Everything a peer sends here is checked for type and form first (hex of the right length, ASCII),
so a malformed handshake is a counted ``ProtocolError``, never another exception.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any, Mapping

from worker.protocol.connection import Connection
from worker.protocol.frames import NONCE_BYTES, PROTOCOL_VERSION, Message, MsgType, ProtocolError
from worker.protocol.session import Session

MAC_HEX = 64  # hex digits of an HMAC-SHA256


def _mac(secret: bytes, *parts: bytes) -> str:
    return hmac.new(secret, b"|".join(parts), hashlib.sha256).hexdigest()


def _identity(fields: Mapping[str, Any]) -> bytes:
    return json.dumps({k: fields.get(k) for k in ("role", "group", "workers", "run_id")}, sort_keys=True).encode()


def _hex_field(fields: Mapping[str, Any], key: str, nbytes: int, what: str) -> bytes:
    """``fields[key]`` as bytes: exactly ``nbytes`` bytes as ASCII hex, else ProtocolError ``bad_handshake``."""
    value = fields.get(key)
    if not (isinstance(value, str) and len(value) == 2 * nbytes and value.isascii()):
        raise ProtocolError("bad_handshake", f"{what} {key!r} is not {nbytes} bytes of hex")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise ProtocolError("bad_handshake", f"{what} {key!r} is not {nbytes} bytes of hex") from None


def _mac_matches(expected: str, given: bytes) -> bool:
    return hmac.compare_digest(expected.encode("ascii"), given.hex().encode("ascii"))


def server_handshake(conn: Connection, secret: bytes, run_id: str, *, deadline: float) -> Message:
    """Challenge a new peer; return its verified HELLO. Raises ProtocolError (reason ``bad_auth`` etc.)."""
    nonce = os.urandom(NONCE_BYTES)
    conn.send(MsgType.CHALLENGE, {"nonce": nonce.hex(), "protocol": PROTOCOL_VERSION, "run_id": run_id})
    hello = conn.recv(deadline=deadline)
    if hello.type != MsgType.HELLO:
        raise ProtocolError("bad_handshake", f"expected HELLO, got {hello.type.name}")
    f = hello.fields
    client_nonce = _hex_field(f, "nonce", NONCE_BYTES, "HELLO")
    mac = _hex_field(f, "mac", MAC_HEX // 2, "HELLO")
    if f.get("run_id") != run_id:
        raise ProtocolError("bad_auth", f"HELLO for run {str(f.get('run_id'))[:64]!r}, this is {run_id!r}")
    if not _mac_matches(_mac(secret, b"hello", nonce, client_nonce, _identity(f)), mac):
        raise ProtocolError("bad_auth", "HMAC does not match the run secret")
    if not (isinstance(f.get("group"), int) and isinstance(f.get("workers"), int) and f["workers"] >= 1
            and 0 <= f["group"] < 1 << 20 and f["workers"] < 1 << 20):
        raise ProtocolError("bad_handshake", "HELLO group/workers are not sane integers")
    conn.authenticated = True
    conn._server_nonce = nonce  # type: ignore[attr-defined]
    conn._client_nonce = client_nonce  # type: ignore[attr-defined]
    conn._run_id = run_id  # type: ignore[attr-defined]
    return hello


def server_welcome(conn: Connection, secret: bytes, info: Mapping[str, Any]) -> None:
    """Prove to the peer that the master holds the secret too, tell it about the run, start the session.

    The WELCOME must stay under ``PREAUTH_MAX_FRAME``: the group reads it with that limit."""
    server_nonce, client_nonce = conn._server_nonce, conn._client_nonce  # type: ignore[attr-defined]
    mac = _mac(secret, b"welcome", server_nonce, client_nonce)
    conn.send(MsgType.WELCOME, {**info, "mac": mac})
    conn.session = Session.for_master(secret, server_nonce, client_nonce, conn._run_id)  # type: ignore[attr-defined]


def client_handshake(conn: Connection, secret: bytes, *, run_id: str, group: int, workers: int,
                     deadline: float) -> Message:
    """Answer the master's challenge and verify its WELCOME; start the session. Returns the WELCOME."""
    challenge = conn.recv(deadline=deadline)
    if challenge.type == MsgType.REJECT:
        raise ProtocolError("rejected", str(challenge.fields.get("reason", ""))[:200])
    if challenge.type != MsgType.CHALLENGE:
        raise ProtocolError("bad_handshake", f"expected CHALLENGE, got {challenge.type.name}")
    nonce = _hex_field(challenge.fields, "nonce", NONCE_BYTES, "CHALLENGE")
    client_nonce = os.urandom(NONCE_BYTES)
    fields = {"role": "group", "group": group, "workers": workers, "run_id": run_id, "nonce": client_nonce.hex()}
    fields["mac"] = _mac(secret, b"hello", nonce, client_nonce, _identity(fields))
    conn.send(MsgType.HELLO, fields)
    welcome = conn.recv(deadline=deadline)  # still unauthenticated: at most PREAUTH_MAX_FRAME bytes
    if welcome.type == MsgType.REJECT:
        raise ProtocolError("rejected", str(welcome.fields.get("reason", ""))[:200])
    if welcome.type != MsgType.WELCOME:
        raise ProtocolError("bad_handshake", f"expected WELCOME, got {welcome.type.name}")
    try:
        mac = _hex_field(welcome.fields, "mac", MAC_HEX // 2, "WELCOME")
    except ProtocolError:
        raise ProtocolError("bad_auth", "the master's WELCOME carries no valid MAC") from None
    if not _mac_matches(_mac(secret, b"welcome", nonce, client_nonce), mac):
        raise ProtocolError("bad_auth", "the master's WELCOME is not signed with the run secret")
    conn.authenticated = True
    conn.session = Session.for_group(secret, nonce, client_nonce, run_id)
    return welcome
