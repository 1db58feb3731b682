"""The wire protocol between the master and worker groups: length-prefixed frames over TCP.

A frame is a fixed 12-byte header followed by a payload::

    magic b"LNCH" | version u8 | type u8 | flags u16 (0) | payload length u32      (network byte order)
    payload = meta length u32 | meta (UTF-8 JSON object) | array bytes ...

The JSON meta holds plain fields (``"f"``) and array descriptors (``"a"``: ``[name, dtype, shape]``);
the arrays follow as raw C-order bytes, in that order, so numpy decodes them without a copy. Only a
whitelist of dtypes is accepted and the declared sizes must add up to the payload exactly. Nothing a
peer sends is unpickled or evaluated.

Authentication is an HMAC-SHA256 challenge-response on the run secret, both ways: the master sends a
random nonce, the group answers with ``HMAC(secret, "hello" | nonces | its identity)``, the master
answers with ``HMAC(secret, "welcome" | nonces)``. Nonces are fresh per connection, so a recorded
handshake cannot be replayed. Frames before authentication are limited to :data:`PREAUTH_MAX_FRAME`.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

MAGIC = b"LNCH"
PROTOCOL_VERSION = 1
HEADER = struct.Struct("!4sBBHI")
HEADER_SIZE = HEADER.size  # 12
META_LEN = struct.Struct("!I")
PREAUTH_MAX_FRAME = 4096  # a handshake frame is ~300 bytes; nothing bigger before the peer is known
MAX_META_BYTES = 1 << 20
NONCE_BYTES = 32

# dtype codes accepted on the wire; anything else is rejected before any allocation.
DTYPES = {
    "f2": np.dtype("<f2"),
    "f4": np.dtype("<f4"),
    "f8": np.dtype("<f8"),
    "i1": np.dtype("i1"),
    "u1": np.dtype("u1"),
    "i2": np.dtype("<i2"),
    "i4": np.dtype("<i4"),
    "i8": np.dtype("<i8"),
    "b1": np.dtype("?"),
}
_CODE_OF = {v: k for k, v in DTYPES.items()}


class MsgType(enum.IntEnum):
    CHALLENGE = 1  # master -> group: nonce
    HELLO = 2  # group -> master: identity + HMAC
    WELCOME = 3  # master -> group: HMAC + run info (followed by WEIGHTS)
    REJECT = 4  # master -> group: reason, then close
    WEIGHTS = 5  # master -> group: model weights + version
    GRADS = 6  # group -> master (A3C): gradients + stats
    TRAJ = 7  # group -> master (PPO): trajectory segment + stats
    HEARTBEAT = 8  # both ways
    STOP = 9  # master -> group: the run is over
    BYE = 10  # group -> master: leaving on purpose


class ProtocolError(Exception):
    """A frame or handshake that breaks the protocol. ``reason`` is a short counter key."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class PeerClosed(ConnectionError):
    """The peer closed the connection (cleanly or not) before a whole frame arrived."""


@dataclass
class Message:
    type: MsgType
    fields: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    nbytes: int = 0  # payload size on the wire


# ---------------------------------------------------------------------------------------------- encoding


def _array_descriptor(name: str, arr: np.ndarray) -> list[Any]:
    dt = arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype
    code = _CODE_OF.get(np.dtype(dt))
    if code is None:
        raise ValueError(f"array {name!r}: dtype {arr.dtype} cannot travel on the wire")
    return [name, code, list(arr.shape)]


def encode_parts(msg_type: MsgType, fields: Mapping[str, Any] | None = None,
                 arrays: Mapping[str, np.ndarray] | None = None) -> list[memoryview | bytes]:
    """Encode a frame as a list of buffers (header+meta, then each array's bytes, uncopied)."""
    arrays = arrays or {}
    bufs: list[memoryview | bytes] = []
    descs = []
    for name, arr in arrays.items():
        a = np.ascontiguousarray(arr)
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        descs.append(_array_descriptor(name, a))
        bufs.append(memoryview(a).cast("B") if a.size else b"")
    meta = json.dumps({"f": dict(fields or {}), "a": descs}, separators=(",", ":"), allow_nan=False).encode()
    payload_len = META_LEN.size + len(meta) + sum(len(b) for b in bufs)
    if payload_len > 0xFFFFFFFF:
        raise ValueError(f"frame payload of {payload_len} bytes does not fit the 32-bit length field")
    head = HEADER.pack(MAGIC, PROTOCOL_VERSION, int(msg_type), 0, payload_len) + META_LEN.pack(len(meta)) + meta
    return [head, *bufs]


def encode(msg_type: MsgType, fields: Mapping[str, Any] | None = None,
           arrays: Mapping[str, np.ndarray] | None = None) -> bytes:
    """Encode a frame into one bytes object (for frames sent to many peers: encode once, send often)."""
    return b"".join(bytes(p) if isinstance(p, memoryview) else p for p in encode_parts(msg_type, fields, arrays))


def parse_header(header: bytes | memoryview, max_frame_bytes: int) -> tuple[MsgType, int]:
    """Check a 12-byte header; return (type, payload length). Raises ProtocolError."""
    magic, version, mtype, flags, length = HEADER.unpack(header)
    if magic != MAGIC:
        raise ProtocolError("bad_magic", f"magic {bytes(magic)!r} is not {MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise ProtocolError("bad_version", f"protocol version {version}, this side speaks {PROTOCOL_VERSION}")
    try:
        t = MsgType(mtype)
    except ValueError:
        raise ProtocolError("bad_type", f"unknown message type {mtype}") from None
    if flags != 0:
        raise ProtocolError("malformed", f"reserved flags {flags:#x} are not zero")
    if length > max_frame_bytes:
        raise ProtocolError("oversize", f"payload length {length} exceeds the limit of {max_frame_bytes} bytes")
    if length < META_LEN.size:
        raise ProtocolError("malformed", f"payload length {length} is shorter than the meta length field")
    return t, length


Layout = list[tuple[str, np.dtype, tuple[int, ...], int, int]]  # name, dtype, shape, count, nbytes


def parse_meta(meta_bytes: bytes, arrays_bytes: int) -> tuple[dict[str, Any], Layout]:
    """Parse a frame's JSON meta; check its array descriptors against the ``arrays_bytes`` that follow.

    Returns (fields, layout). Raises ProtocolError: bad JSON, bad descriptors, sizes that do not add up.
    """
    try:
        meta = json.loads(meta_bytes.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError, RecursionError) as exc:
        # RecursionError: 4 KiB of '[' nests past the parser's limit; it must not escape as a crash.
        raise ProtocolError("malformed", f"meta is not valid JSON: {exc}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("f", {}), dict) or not isinstance(meta.get("a", []), list):
        raise ProtocolError("malformed", "meta must be an object with 'f' (object) and 'a' (list)")
    layout: Layout = []
    left = arrays_bytes
    for desc in meta.get("a", []):
        if not (isinstance(desc, list) and len(desc) == 3 and isinstance(desc[0], str)
                and isinstance(desc[1], str) and isinstance(desc[2], list)):
            raise ProtocolError("malformed", f"array descriptor {str(desc)[:80]!r} is not [name, dtype, shape]")
        name, code, shape = desc
        dtype = DTYPES.get(code)
        if dtype is None:
            raise ProtocolError("bad_dtype", f"array {name[:40]!r}: dtype {code[:10]!r} is not accepted")
        if len(shape) > 8 or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 31 for d in shape):
            raise ProtocolError("malformed", f"array {name[:40]!r}: bad shape {str(shape)[:80]}")
        count = 1
        for d in shape:
            count *= d
        nbytes = count * dtype.itemsize
        if nbytes > left:
            raise ProtocolError("malformed", f"array {name[:40]!r} needs {nbytes} bytes, {left} left")
        layout.append((name, dtype, tuple(shape), count, nbytes))
        left -= nbytes
    if left != 0:
        raise ProtocolError("malformed", f"{left} trailing bytes after the declared arrays")
    return meta.get("f", {}), layout


def _check_meta_len(meta_len: int, total: int) -> None:
    if meta_len > MAX_META_BYTES or META_LEN.size + meta_len > total:
        raise ProtocolError("malformed", f"meta length {meta_len} does not fit a payload of {total} bytes")


def decode_payload(msg_type: MsgType, payload: memoryview) -> Message:
    """Decode a payload into fields and arrays (arrays are read-only views into ``payload``)."""
    total = len(payload)
    (meta_len,) = META_LEN.unpack_from(payload, 0)
    _check_meta_len(meta_len, total)
    offset = META_LEN.size + meta_len
    fields, layout = parse_meta(bytes(payload[META_LEN.size:offset]), total - offset)
    arrays: dict[str, np.ndarray] = {}
    for name, dtype, shape, count, nbytes in layout:
        arrays[name] = np.frombuffer(payload, dtype=dtype, count=count, offset=offset).reshape(shape)
        offset += nbytes
    return Message(type=msg_type, fields=fields, arrays=arrays, nbytes=total)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in meta")


# ------------------------------------------------------------------------------------------- connection


class Connection:
    """A framed, blocking TCP connection. ``send`` is thread-safe; ``recv`` is for one reader thread.

    Args:
        sock: a connected socket.
        max_frame_bytes: largest payload accepted after authentication.
        timeout_s: per-operation socket timeout; a recv or send that waits longer raises ``TimeoutError``.
    """

    def __init__(self, sock: socket.socket, *, max_frame_bytes: int, timeout_s: float | None, peer: str = "") -> None:
        self.sock = sock
        self.max_frame_bytes = max_frame_bytes
        self.authenticated = False
        self.peer = peer or _peer_name(sock)
        self._send_lock = threading.Lock()
        self._header = bytearray(HEADER_SIZE)
        self._rbuf: np.ndarray | None = None
        self.bytes_in = 0
        self.bytes_out = 0
        self.last_recv = time.monotonic()
        self.closed = False
        self.timeout_s = timeout_s
        sock.settimeout(timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass

    # -- sending
    def send(self, msg_type: MsgType, fields: Mapping[str, Any] | None = None,
             arrays: Mapping[str, np.ndarray] | None = None) -> None:
        self.send_parts(encode_parts(msg_type, fields, arrays))

    def send_parts(self, parts: Sequence[bytes | memoryview]) -> None:
        """Send pre-encoded buffers as one frame (scatter-gather, no concatenation copy)."""
        with self._send_lock:
            _sendall_parts(self.sock, parts)
            self.bytes_out += sum(len(p) for p in parts)

    # -- receiving
    def recv(self, *, deadline: float | None = None, reuse_buffer: bool = False,
             into: Callable[[MsgType, dict[str, Any]], Mapping[str, np.ndarray] | None] | None = None) -> Message:
        """Read one whole frame. Raises ProtocolError, PeerClosed, TimeoutError.

        With ``reuse_buffer`` the payload lands in a buffer kept by this connection (no allocation and
        no page faults per frame: a fresh 20 MB buffer costs ~5 ms of first-touch faults); the decoded
        arrays are then only valid until the next ``recv``. For a reader that consumes each message
        before reading the next (a worker group), not for one that queues them (the master).

        ``into(type, fields)`` may name arrays the payload should be received into directly (by array name;
        used when dtype and shape match exactly): a weight broadcast lands in the group's spare weight
        arrays with no copy at all. Those arrays are then the message's arrays.
        """
        limit = self.max_frame_bytes if self.authenticated else PREAUTH_MAX_FRAME
        if deadline is None:
            self.sock.settimeout(self.timeout_s)
        hv = memoryview(self._header)
        self._recv_into(hv, deadline)
        mtype, length = parse_header(hv, limit)
        if into is not None:
            return self._recv_direct(mtype, length, deadline, into)
        # np.empty: no zero-fill of a buffer we are about to overwrite (20 MB zeroing costs ~2 ms).
        if reuse_buffer:
            if self._rbuf is None or len(self._rbuf) < length:
                self._rbuf = np.empty(max(length, 2 * (0 if self._rbuf is None else len(self._rbuf))), np.uint8)
            view = memoryview(self._rbuf).cast("B")[:length]
        else:
            view = memoryview(np.empty(length, dtype=np.uint8)).cast("B")
        self._recv_into(view, deadline)
        self.bytes_in += HEADER_SIZE + length
        self.last_recv = time.monotonic()
        return decode_payload(mtype, view)

    def _recv_direct(self, mtype: MsgType, length: int, deadline: float | None,
                     into: Callable[[MsgType, dict[str, Any]], Mapping[str, np.ndarray] | None]) -> Message:
        head = bytearray(META_LEN.size)
        self._recv_into(memoryview(head), deadline)
        (meta_len,) = META_LEN.unpack(head)
        _check_meta_len(meta_len, length)
        meta = bytearray(meta_len)
        self._recv_into(memoryview(meta), deadline)
        fields, layout = parse_meta(bytes(meta), length - META_LEN.size - meta_len)
        targets = into(mtype, fields) or {}
        scratch_bytes = sum(nb for name, dt, shape, _, nb in layout if not _fits(targets.get(name), dt, shape))
        scratch = memoryview(np.empty(scratch_bytes, np.uint8)).cast("B")
        arrays: dict[str, np.ndarray] = {}
        offset = 0
        for name, dtype, shape, count, nbytes in layout:
            target = targets.get(name)
            if _fits(target, dtype, shape):
                assert target is not None
                if nbytes:
                    self._recv_into(memoryview(target).cast("B"), deadline)
                arrays[name] = target
            else:
                view = scratch[offset:offset + nbytes]
                self._recv_into(view, deadline)
                arrays[name] = np.frombuffer(view, dtype=dtype, count=count).reshape(shape)
                offset += nbytes
        self.bytes_in += HEADER_SIZE + length
        self.last_recv = time.monotonic()
        return Message(type=mtype, fields=fields, arrays=arrays, nbytes=length)

    def _recv_into(self, view: memoryview, deadline: float | None) -> None:
        got, n = 0, len(view)
        while got < n:
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"deadline passed with {got} of {n} bytes read")
                self.sock.settimeout(remaining)
            try:
                k = self.sock.recv_into(view[got:], n - got)
            except socket.timeout:
                raise TimeoutError(f"timed out with {got} of {n} bytes read") from None
            if k == 0:
                raise PeerClosed(f"peer {self.peer} closed the connection ({got} of {n} bytes read)")
            got += k

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _fits(target: np.ndarray | None, dtype: np.dtype, shape: tuple[int, ...]) -> bool:
    return (target is not None and target.dtype == dtype and target.shape == shape
            and target.flags.c_contiguous and target.flags.writeable)


def _sendall_parts(sock: socket.socket, parts: Sequence[bytes | memoryview]) -> None:
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        try:
            sent = sock.sendmsg(views[:512])
        except socket.timeout:
            raise TimeoutError("send timed out") from None
        while sent and views:
            head = views[0]
            if sent >= len(head):
                sent -= len(head)
                views.pop(0)
            else:
                views[0] = head[sent:]
                sent = 0


def _peer_name(sock: socket.socket) -> str:
    try:
        name = sock.getpeername()
    except OSError:
        return "?"
    if isinstance(name, tuple) and len(name) >= 2:
        return f"{name[0]}:{name[1]}"
    return str(name) or "local"


# -------------------------------------------------------------------------------------------- handshake


def _mac(secret: bytes, *parts: bytes) -> str:
    return hmac.new(secret, b"|".join(parts), hashlib.sha256).hexdigest()


def _identity(fields: Mapping[str, Any]) -> bytes:
    return json.dumps({k: fields.get(k) for k in ("role", "group", "workers", "run_id")}, sort_keys=True).encode()


def server_handshake(conn: Connection, secret: bytes, run_id: str, *, deadline: float) -> Message:
    """Challenge a new peer; return its verified HELLO. Raises ProtocolError (reason ``bad_auth`` etc.)."""
    nonce = os.urandom(NONCE_BYTES)
    conn.send(MsgType.CHALLENGE, {"nonce": nonce.hex(), "protocol": PROTOCOL_VERSION, "run_id": run_id})
    hello = conn.recv(deadline=deadline)
    if hello.type != MsgType.HELLO:
        raise ProtocolError("bad_handshake", f"expected HELLO, got {hello.type.name}")
    f = hello.fields
    try:
        client_nonce = bytes.fromhex(str(f.get("nonce", "")))
        mac = str(f["mac"])
    except (KeyError, ValueError):
        raise ProtocolError("bad_handshake", "HELLO lacks a hex nonce and mac") from None
    if len(client_nonce) != NONCE_BYTES:
        raise ProtocolError("bad_handshake", f"client nonce is {len(client_nonce)} bytes, not {NONCE_BYTES}")
    if f.get("run_id") != run_id:
        raise ProtocolError("bad_auth", f"HELLO for run {str(f.get('run_id'))[:64]!r}, this is {run_id!r}")
    expected = _mac(secret, b"hello", nonce, client_nonce, _identity(f))
    if not hmac.compare_digest(expected, mac):
        raise ProtocolError("bad_auth", "HMAC does not match the run secret")
    if not (isinstance(f.get("group"), int) and isinstance(f.get("workers"), int) and f["workers"] >= 1
            and 0 <= f["group"] < 1 << 20):
        raise ProtocolError("bad_handshake", "HELLO group/workers are not sane integers")
    conn.authenticated = True
    conn._server_nonce = nonce  # type: ignore[attr-defined]
    conn._client_nonce = client_nonce  # type: ignore[attr-defined]
    return hello


def server_welcome(conn: Connection, secret: bytes, info: Mapping[str, Any]) -> None:
    """Prove to the peer that the master holds the secret too, and tell it about the run."""
    mac = _mac(secret, b"welcome", conn._server_nonce, conn._client_nonce)  # type: ignore[attr-defined]
    conn.send(MsgType.WELCOME, {**info, "mac": mac})


def client_handshake(conn: Connection, secret: bytes, *, run_id: str, group: int, workers: int,
                     deadline: float) -> Message:
    """Answer the master's challenge and verify its WELCOME. Returns the WELCOME message."""
    challenge = conn.recv(deadline=deadline)
    if challenge.type == MsgType.REJECT:
        raise ProtocolError("rejected", str(challenge.fields.get("reason", "")))
    if challenge.type != MsgType.CHALLENGE:
        raise ProtocolError("bad_handshake", f"expected CHALLENGE, got {challenge.type.name}")
    nonce = bytes.fromhex(str(challenge.fields.get("nonce", "")))
    client_nonce = os.urandom(NONCE_BYTES)
    fields = {"role": "group", "group": group, "workers": workers, "run_id": run_id, "nonce": client_nonce.hex()}
    fields["mac"] = _mac(secret, b"hello", nonce, client_nonce, _identity(fields))
    conn.send(MsgType.HELLO, fields)
    conn.authenticated = True  # the next frame may be large-ish (WELCOME); still checked below
    welcome = conn.recv(deadline=deadline)
    if welcome.type == MsgType.REJECT:
        raise ProtocolError("rejected", str(welcome.fields.get("reason", "")))
    if welcome.type != MsgType.WELCOME:
        raise ProtocolError("bad_handshake", f"expected WELCOME, got {welcome.type.name}")
    expected = _mac(secret, b"welcome", nonce, client_nonce)
    if not hmac.compare_digest(expected, str(welcome.fields.get("mac", ""))):
        conn.authenticated = False
        raise ProtocolError("bad_auth", "the master's WELCOME is not signed with the run secret")
    return welcome


def all_finite(arrays: Mapping[str, np.ndarray]) -> bool:
    """True when every floating array is free of NaN and Inf."""
    for a in arrays.values():
        if a.dtype.kind == "f" and a.size and not np.isfinite(a).all():
            return False
    return True
