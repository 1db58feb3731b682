"""Frames: the bytes of one message on the wire, and nothing about sockets or keys.

A frame is a fixed 12-byte header followed by a payload::

    magic b"LNCH" | version u8 | type u8 | flags u16 | payload length u32      (network byte order)
    payload = meta length u32 | meta (UTF-8 JSON object) | array bytes ...

Flags are 0 during the handshake and ``FLAG_SEALED`` after it: the payload is then followed by a 40-byte
trailer (sequence number and MAC, :mod:`worker.protocol.session`) that the payload length does not count.

The JSON meta holds plain fields (``"f"``) and array descriptors (``"a"``: ``[name, dtype, shape]``);
the arrays follow as raw C-order bytes, in that order, so numpy decodes them without a copy. Only a
whitelist of dtypes is accepted and the declared sizes must add up to the payload exactly. Nothing a
peer sends is unpickled or evaluated. Any malformed input ends as a :class:`ProtocolError` whose
``reason`` becomes a ``rejected.<reason>`` counter, never as another exception.
"""

from __future__ import annotations

import enum
import hashlib
import json
import struct
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

MAGIC = b"LNCH"
PROTOCOL_VERSION = 3  # 2: frames after the handshake are sealed; 3: SETUP, payloads of any algorithm
HEADER = struct.Struct("!4sBBHI")
HEADER_SIZE = HEADER.size  # 12
META_LEN = struct.Struct("!I")
PREAUTH_MAX_FRAME = 4096  # a handshake frame is ~300 bytes; nothing bigger before the peer is known
MAX_META_BYTES = 1 << 20
NONCE_BYTES = 32
FLAG_SEALED = 0x0001
PAYLOAD_HASH = hashlib.sha256  # the payload's hash under a sealed frame's MAC (see worker.protocol.session)
# numpy refuses shapes whose element count overflows (``[0, 2**31-1, 2**31-1]`` holds no bytes but is
# "too big"); a declared shape must stay under this many elements even with its zero dimensions ignored.
MAX_DECLARED_ELEMENTS = 1 << 40

# dtype codes accepted on the wire; anything else is rejected before any allocation.
DTYPES: dict[str, np.dtype[Any]] = {
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
    WELCOME = 3  # master -> group: HMAC + run info (followed by SETUP, then WEIGHTS)
    REJECT = 4  # master -> group: reason, then close
    WEIGHTS = 5  # master -> group: model weights + extras + version ("unchanged": the version the group has)
    GRADS = 6  # retired in protocol 3 (payloads of every algorithm are TRAJ); refused
    TRAJ = 7  # group -> master: a payload (the algorithm's named arrays) + the launcher's episode counts
    HEARTBEAT = 8  # both ways
    STOP = 9  # master -> group: the run is over
    BYE = 10  # group -> master: leaving on purpose (with "error": the algorithm's code raised in the group)
    SETUP = 11  # master -> group: how to act (numpy program or TensorFlow), the weights' names, the schedule


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


class EncodedFrame(list):  # type: ignore[type-arg]
    """A frame as a list of buffers (header+meta, then each array's bytes, uncopied), plus the SHA-256 of
    its payload, computed once on first use: a frame sent to many peers is hashed once, not per peer."""

    _lock = threading.Lock()

    @property
    def digest(self) -> bytes:
        d = self.__dict__.get("_digest")
        if d is None:
            with self._lock:
                d = self.__dict__.get("_digest")
                if d is None:
                    h = PAYLOAD_HASH(memoryview(self[0])[HEADER_SIZE:])
                    for part in self[1:]:
                        h.update(part)
                    d = self.__dict__["_digest"] = h.digest()
        return d


def encode_parts(msg_type: MsgType, fields: Mapping[str, Any] | None = None,
                 arrays: Mapping[str, np.ndarray] | None = None) -> EncodedFrame:
    """Encode a frame as a list of buffers (header+meta, then each array's bytes, uncopied)."""
    arrays = arrays or {}
    bufs: list[memoryview | bytes] = []
    descs = []
    for name, arr in arrays.items():
        a = np.asarray(arr)
        if not a.flags.c_contiguous:  # (np.ascontiguousarray would also turn a 0-d array, a scalar weight, 1-d)
            a = np.ascontiguousarray(a)
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        descs.append(_array_descriptor(name, a))
        bufs.append(a.reshape(-1).data.cast("B") if a.size else b"")
    meta = json.dumps({"f": dict(fields or {}), "a": descs}, separators=(",", ":"), allow_nan=False).encode()
    payload_len = META_LEN.size + len(meta) + sum(len(b) for b in bufs)
    if payload_len > 0xFFFFFFFF:
        raise ValueError(f"frame payload of {payload_len} bytes does not fit the 32-bit length field")
    head = HEADER.pack(MAGIC, PROTOCOL_VERSION, int(msg_type), 0, payload_len) + META_LEN.pack(len(meta)) + meta
    return EncodedFrame([head, *bufs])


def encode(msg_type: MsgType, fields: Mapping[str, Any] | None = None,
           arrays: Mapping[str, np.ndarray] | None = None) -> bytes:
    """Encode a frame into one bytes object (for frames sent to many peers: encode once, send often)."""
    return b"".join(bytes(p) if isinstance(p, memoryview) else p for p in encode_parts(msg_type, fields, arrays))


def parse_header(header: bytes | memoryview, max_frame_bytes: int, *, sealed: bool = False) -> tuple[MsgType, int]:
    """Check a 12-byte header; return (type, payload length). Raises ProtocolError.

    ``sealed``: the connection has a session, so the frame must carry ``FLAG_SEALED`` (an unsealed frame
    there is an injection: reason ``unsealed``)."""
    magic, version, mtype, flags, length = HEADER.unpack(header)
    if magic != MAGIC:
        raise ProtocolError("bad_magic", f"magic {bytes(magic)!r} is not {MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise ProtocolError("bad_version", f"protocol version {version}, this side speaks {PROTOCOL_VERSION}")
    try:
        t = MsgType(mtype)
    except ValueError:
        raise ProtocolError("bad_type", f"unknown message type {mtype}") from None
    if sealed and flags == 0:
        raise ProtocolError("unsealed", "a frame without a MAC on an authenticated connection")
    if flags != (FLAG_SEALED if sealed else 0):
        raise ProtocolError("malformed", f"flags {flags:#x} are not {FLAG_SEALED if sealed else 0:#x}")
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
        count, declared = 1, 1
        for d in shape:
            count *= d
            declared *= max(d, 1)
        if declared > MAX_DECLARED_ELEMENTS:
            raise ProtocolError("malformed", f"array {name[:40]!r}: shape {str(shape)[:80]} is too big")
        nbytes = count * dtype.itemsize
        if nbytes > left:
            raise ProtocolError("malformed", f"array {name[:40]!r} needs {nbytes} bytes, {left} left")
        layout.append((name, dtype, tuple(shape), count, nbytes))
        left -= nbytes
    if left != 0:
        raise ProtocolError("malformed", f"{left} trailing bytes after the declared arrays")
    return meta.get("f", {}), layout


def check_meta_len(meta_len: int, total: int) -> None:
    if meta_len > MAX_META_BYTES or META_LEN.size + meta_len > total:
        raise ProtocolError("malformed", f"meta length {meta_len} does not fit a payload of {total} bytes")


def decode_payload(msg_type: MsgType, payload: memoryview) -> Message:
    """Decode a payload into fields and arrays (arrays are read-only views into ``payload``)."""
    total = len(payload)
    (meta_len,) = META_LEN.unpack_from(payload, 0)
    check_meta_len(meta_len, total)
    offset = META_LEN.size + meta_len
    fields, layout = parse_meta(bytes(payload[META_LEN.size:offset]), total - offset)
    arrays: dict[str, np.ndarray] = {}
    for name, dtype, shape, count, nbytes in layout:
        arrays[name] = as_array(payload[offset:offset + nbytes], name, dtype, count, shape)
        offset += nbytes
    return Message(type=msg_type, fields=fields, arrays=arrays, nbytes=total)


def as_array(buf: memoryview, name: str, dtype: np.dtype, count: int, shape: tuple[int, ...]) -> np.ndarray:
    """A read-only view of ``buf`` as the declared array; numpy's own refusals become ProtocolError."""
    try:
        return np.frombuffer(buf, dtype=dtype, count=count).reshape(shape)
    except (ValueError, TypeError, OverflowError) as exc:
        raise ProtocolError("malformed", f"array {name[:40]!r}: {str(exc)[:80]}") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in meta")


def all_finite(arrays: Mapping[str, np.ndarray]) -> bool:
    """True when every floating array is free of NaN and Inf."""
    for a in arrays.values():
        if a.dtype.kind == "f" and a.size and not np.isfinite(a).all():
            return False
    return True
