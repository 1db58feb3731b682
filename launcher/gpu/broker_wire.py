"""The lease broker's wire format, shared by the broker (:mod:`launcher.gpu.broker`) and its client
(:mod:`launcher.gpu.broker_client`): one JSON object on one line each way, and the checks a request must pass.

Requests (``op``): ``lease {run_id, uuids, count|null}``, ``tie {uuids, pid}``, ``release {uuids}``, ``list``;
each may carry ``schema`` (:data:`SCHEMA`). Replies: ``{"ok": true, ...}`` or ``{"ok": false, "refusal":
<one of REFUSALS>, "error": ..., "hint": ...}``. Who asks is never in a request: it is the socket's
``SO_PEERCRED`` (:func:`peer_credentials`). Pure functions over typed data, except :func:`peer_credentials`.
"""

from __future__ import annotations

import json
import socket
import struct
from dataclasses import dataclass
from typing import Any, Union

from launcher.gpu.store import valid_uuid

SCHEMA = "launcher.broker/v1"
MAX_REQUEST_BYTES = 4096  # one request line, newline included; the broker refuses longer ones
MAX_REPLY_BYTES = 256 * 1024  # a `list` reply of many leases; a lease reply is a few hundred bytes
MAX_UUIDS = 64  # in one request
MAX_RUN_ID = 200  # characters
REFUSALS = ("busy", "cap", "denied", "bad", "internal")
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class Refusal(Exception):
    """A request the broker answers with ``ok: false`` (its ``kind``, one of :data:`REFUSALS`, is the reply's
    ``refusal``)."""

    def __init__(self, kind: str, error: str, hint: str | None = None) -> None:
        super().__init__(error)
        self.kind, self.error, self.hint = kind, error, hint

    def reply(self) -> dict[str, Any]:
        return {"ok": False, "refusal": self.kind, "error": self.error, **({"hint": self.hint} if self.hint else {})}


@dataclass(frozen=True)
class LeaseRequest:
    run_id: str
    uuids: tuple[str, ...]
    count: int | None  # None: all of uuids; else the first ``count`` free among them


@dataclass(frozen=True)
class TieRequest:
    uuids: tuple[str, ...]
    pid: int


@dataclass(frozen=True)
class ReleaseRequest:
    uuids: tuple[str, ...]


@dataclass(frozen=True)
class ListRequest:
    pass


Request = Union[LeaseRequest, TieRequest, ReleaseRequest, ListRequest]


def encode(message: dict[str, Any]) -> bytes:
    """One message as its line on the wire."""
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def request_line(request: dict[str, Any]) -> bytes:
    """A client's request (``op`` and its fields) as its line, with the schema."""
    return encode({"schema": SCHEMA, **request})


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected Unix socket, from the kernel."""
    pid, uid, gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid, gid


def _uuids(req: dict[str, Any]) -> tuple[str, ...]:
    uuids = req.get("uuids")
    if not isinstance(uuids, list) or not uuids or len(uuids) > MAX_UUIDS:
        raise Refusal("bad", f"uuids must be a list of 1 to {MAX_UUIDS} GPU UUIDs, got {str(uuids)[:80]}")
    bad = [u for u in uuids if not isinstance(u, str) or not valid_uuid(u)]
    if bad:
        raise Refusal("bad", f"not a GPU UUID: {str(bad[0])[:80]!r}")
    return tuple(dict.fromkeys(uuids))


def _lease(req: dict[str, Any]) -> LeaseRequest:
    uuids = _uuids(req)
    run_id, count = req.get("run_id"), req.get("count")
    if not isinstance(run_id, str) or not 0 < len(run_id) <= MAX_RUN_ID or not run_id.isprintable():
        raise Refusal("bad", f"run_id must be printable text of 1 to {MAX_RUN_ID} characters, got {str(run_id)[:80]!r}")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or not 0 < count <= len(uuids)):
        raise Refusal("bad", f"count must be null or a whole number from 1 to {len(uuids)}, got {count!r}")
    return LeaseRequest(run_id, uuids, count)


def _tie(req: dict[str, Any]) -> TieRequest:
    uuids = _uuids(req)
    pid = req.get("pid")
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        raise Refusal("bad", f"pid must be a positive whole number, got {pid!r}")
    return TieRequest(uuids, pid)


def parse_request(line: bytes) -> Request:
    """One request line (without its newline) as a typed request.

    Raises:
        Refusal: ``bad``: not JSON, not an object, another schema, an unknown op or a field out of bounds.
    """
    try:
        req = json.loads(line)
    except ValueError:
        raise Refusal("bad", f"not JSON: {line[:80]!r}", "send one JSON object per line") from None
    if not isinstance(req, dict):
        raise Refusal("bad", f"expected a JSON object, got {type(req).__name__}")
    if req.get("schema", SCHEMA) != SCHEMA:
        raise Refusal("bad", f"schema {req.get('schema')!r} is not {SCHEMA!r}", "use a launcher of the broker's version")
    op = req.get("op")
    if op == "lease":
        return _lease(req)
    if op == "tie":
        return _tie(req)
    if op == "release":
        return ReleaseRequest(_uuids(req))
    if op == "list":
        return ListRequest()
    raise Refusal("bad", f"unknown op {op!r}; expected lease, tie, release or list")


def parse_reply(raw: bytes) -> dict[str, Any] | None:
    """A reply line as its object; None when it is not a JSON object."""
    try:
        reply = json.loads(raw)
    except ValueError:
        return None
    return reply if isinstance(reply, dict) else None
