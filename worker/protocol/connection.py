"""``Connection``: one framed, blocking TCP connection (send whole frames, receive whole frames).

Why blocking sockets and ``recv_into``: each peer has its own reader thread, so blocking costs nothing,
and receiving into a fresh ``np.empty`` buffer (or straight into the group's spare weight arrays) means
a 20 MB weight frame is copied once, by the kernel. ``sendmsg`` sends pre-encoded buffers scatter-gather.

Once the handshake installs a :class:`~worker.protocol.session.Session`, every frame sent is sealed and
every frame received must be: the payload is hashed while it arrives (in 1 MiB pieces, so the hash of
one piece overlaps the kernel receiving the next) and the trailer is checked before anything is decoded.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from worker.protocol import frames
from worker.protocol.frames import (FLAG_SEALED, HEADER, HEADER_SIZE, META_LEN, PREAUTH_MAX_FRAME, EncodedFrame, Message,
                                    MsgType, PeerClosed, as_array, check_meta_len, decode_payload, encode_parts,
                                    parse_header, parse_meta)
from worker.protocol.session import TRAILER_SIZE, Session

HASH_PIECE = 1 << 20  # bytes received between hash updates


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
        self.session: Session | None = None  # set by the handshake; from then on every frame is sealed
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
        """Send pre-encoded buffers as one frame (scatter-gather, no concatenation copy); sealed when the
        connection has a session (the payload's hash is taken from an :class:`EncodedFrame` when it has one)."""
        with self._send_lock:
            if self.session is not None:
                frame = parts if isinstance(parts, EncodedFrame) else EncodedFrame(parts)
                magic, version, mtype, _, length = HEADER.unpack_from(frame[0], 0)
                header = HEADER.pack(magic, version, mtype, FLAG_SEALED, length)
                trailer = self.session.seal(header, frame.digest)
                parts = [header, memoryview(frame[0])[HEADER_SIZE:], *frame[1:], trailer]
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
        mtype, length = parse_header(hv, limit, sealed=self.session is not None)
        if into is not None:
            return self._recv_direct(mtype, length, deadline, into)
        # np.empty: no zero-fill of a buffer we are about to overwrite (20 MB zeroing costs ~2 ms).
        if reuse_buffer:
            if self._rbuf is None or len(self._rbuf) < length:
                self._rbuf = np.empty(max(length, 2 * (0 if self._rbuf is None else len(self._rbuf))), np.uint8)
            view = self._rbuf.data.cast("B")[:length]
        else:
            view = np.empty(length, dtype=np.uint8).data.cast("B")
        h = self._hasher()
        self._recv_into(view, deadline, h)
        self._open(h, deadline)
        self.bytes_in += HEADER_SIZE + length
        self.last_recv = time.monotonic()
        return decode_payload(mtype, view)

    def _hasher(self) -> Any:
        return frames.PAYLOAD_HASH() if self.session is not None else None

    def _open(self, h: Any, deadline: float | None) -> None:
        """Check the trailer of the frame just read (sealed connections only). Raises ProtocolError."""
        if self.session is None:
            return
        trailer = bytearray(TRAILER_SIZE)
        self._recv_into(memoryview(trailer), deadline)
        self.session.open(bytes(self._header), h.digest(), bytes(trailer))

    def _recv_direct(self, mtype: MsgType, length: int, deadline: float | None,
                     into: Callable[[MsgType, dict[str, Any]], Mapping[str, np.ndarray] | None]) -> Message:
        h = self._hasher()
        head = bytearray(META_LEN.size)
        self._recv_into(memoryview(head), deadline, h)
        (meta_len,) = META_LEN.unpack(head)
        check_meta_len(meta_len, length)
        meta = bytearray(meta_len)
        self._recv_into(memoryview(meta), deadline, h)
        # The meta is parsed before the MAC is checked (it says where the arrays go); parse_meta refuses
        # anything malformed and nothing is used until the trailer has been checked below.
        fields, layout = parse_meta(bytes(meta), length - META_LEN.size - meta_len)
        targets = into(mtype, fields) or {}
        scratch_bytes = sum(nb for name, dt, shape, _, nb in layout if not _fits(targets.get(name), dt, shape))
        scratch = np.empty(scratch_bytes, np.uint8).data.cast("B")
        arrays: dict[str, np.ndarray] = {}
        offset = 0
        for name, dtype, shape, count, nbytes in layout:
            target = targets.get(name)
            if _fits(target, dtype, shape):
                assert target is not None
                if nbytes:
                    self._recv_into(target.reshape(-1).data.cast("B"), deadline, h)
                arrays[name] = target
            else:
                view = scratch[offset:offset + nbytes]
                self._recv_into(view, deadline, h)
                arrays[name] = as_array(view, name, dtype, count, shape)
                offset += nbytes
        self._open(h, deadline)
        self.bytes_in += HEADER_SIZE + length
        self.last_recv = time.monotonic()
        return Message(type=mtype, fields=fields, arrays=arrays, nbytes=length)

    def _recv_into(self, view: memoryview, deadline: float | None, h: Any = None) -> None:
        """Fill ``view`` from the socket; with a hasher ``h``, feed it each piece as it arrives."""
        got, n = 0, len(view)
        hashed = 0
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
            if h is not None and (got - hashed >= HASH_PIECE or got == n):
                h.update(view[hashed:got])
                hashed = got

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


def dial(addr: str | tuple[str, int], timeout: float) -> socket.socket:
    """A connected stream socket to the master: ``(host, port)`` over TCP, or a Unix socket's path."""
    if isinstance(addr, tuple):
        return socket.create_connection(addr, timeout=timeout)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(timeout)
        s.connect(addr)
    except BaseException:
        s.close()
        raise
    return s


def _peer_name(sock: socket.socket) -> str:
    try:
        name = sock.getpeername()
    except OSError:
        return "?"
    if isinstance(name, tuple) and len(name) >= 2:
        return f"{name[0]}:{name[1]}"
    return str(name) or "unix"
