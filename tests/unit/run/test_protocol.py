"""The framed protocol: round trips over real sockets, and every way a frame can be refused."""

from __future__ import annotations

import socket
import struct
import threading
import time

import numpy as np
import pytest

from worker import protocol as p
from worker.protocol import Connection, MsgType, ProtocolError

SECRET = b"s" * 32


def pair(max_frame: int = 1 << 26) -> tuple[Connection, Connection]:
    a, b = socket.socketpair()
    return (Connection(a, max_frame_bytes=max_frame, timeout_s=5), Connection(b, max_frame_bytes=max_frame, timeout_s=5))


def authed_pair(max_frame: int = 1 << 26) -> tuple[Connection, Connection]:
    x, y = pair(max_frame)
    x.authenticated = y.authenticated = True
    return x, y


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "int32", "uint8", "bool", "float16", "int8", "int16"])
def test_round_trip_every_dtype(dtype: str) -> None:
    a, b = authed_pair()
    arr = (np.arange(24).reshape(2, 3, 4) % 7).astype(dtype)
    a.send(MsgType.TRAJ, {"version": 7, "name": "x", "nested": {"k": [1, 2]}}, {"arr": arr, "empty": np.zeros((0, 3), dtype)})
    msg = b.recv()
    assert msg.type == MsgType.TRAJ
    assert msg.fields == {"version": 7, "name": "x", "nested": {"k": [1, 2]}}
    np.testing.assert_array_equal(msg.arrays["arr"], arr)
    assert msg.arrays["arr"].dtype == np.dtype(dtype)
    assert msg.arrays["empty"].shape == (0, 3)


def test_big_frame_round_trip_and_byte_order() -> None:
    a, b = authed_pair()
    big = np.random.default_rng(0).standard_normal(5_000_000).astype(np.float32)  # 20 MB
    be = np.arange(10, dtype=">i4")  # big-endian input travels as little-endian
    t = threading.Thread(target=a.send, args=(MsgType.WEIGHTS, {"version": 1}, {"w": big, "be": be}))
    t.start()
    msg = b.recv()
    t.join()
    np.testing.assert_array_equal(msg.arrays["w"], big)
    np.testing.assert_array_equal(msg.arrays["be"], np.arange(10))


def test_encode_once_send_many_is_identical() -> None:
    arrays = {"a": np.ones((3, 3), np.float32)}
    parts = p.encode_parts(MsgType.WEIGHTS, {"version": 3}, arrays)
    assert b"".join(bytes(x) for x in parts) == p.encode(MsgType.WEIGHTS, {"version": 3}, arrays)


def raw_frame(payload: bytes, *, magic: bytes = p.MAGIC, version: int = p.PROTOCOL_VERSION, mtype: int = MsgType.TRAJ,
              flags: int = 0, length: int | None = None) -> bytes:
    return p.HEADER.pack(magic, version, mtype, flags, len(payload) if length is None else length) + payload


def meta_payload(meta: bytes, tail: bytes = b"") -> bytes:
    return struct.pack("!I", len(meta)) + meta + tail


@pytest.mark.parametrize("frame,reason", [
    (raw_frame(meta_payload(b"{}"), magic=b"XXXX"), "bad_magic"),
    (raw_frame(meta_payload(b"{}"), version=99), "bad_version"),
    (raw_frame(meta_payload(b"{}"), mtype=200), "bad_type"),
    (raw_frame(meta_payload(b"{}"), flags=1), "malformed"),
    (raw_frame(b"", length=1 << 30), "oversize"),
    (raw_frame(b"\x00\x00"), "malformed"),
    (raw_frame(meta_payload(b"not json")), "malformed"),
    (raw_frame(meta_payload(b'{"f": {"x": NaN}, "a": []}')), "malformed"),
    (raw_frame(meta_payload(b'{"f": [], "a": []}')), "malformed"),
    (raw_frame(meta_payload(b'{"f": {}, "a": [["x", "O", [1]]]}', b"\0" * 8)), "bad_dtype"),
    (raw_frame(meta_payload(b'{"f": {}, "a": [["x", "f4", [-1]]]}')), "malformed"),
    (raw_frame(meta_payload(b'{"f": {}, "a": [["x", "f4", [1000000]]]}', b"\0" * 8)), "malformed"),
    (raw_frame(meta_payload(b'{"f": {}, "a": [["x", "f4", [1]]]}', b"\0" * 8)), "malformed"),  # trailing bytes
    (raw_frame(meta_payload(b'{"f": {}, "a": [["x", "f4", [2, true]]]}', b"\0" * 8)), "malformed"),
    (raw_frame(struct.pack("!I", 10**9) + b"{}"), "malformed"),
])
def test_bad_frames_are_refused_with_a_reason(frame: bytes, reason: str) -> None:
    a, b = authed_pair(max_frame=1 << 20)
    a.sock.sendall(frame)
    with pytest.raises(ProtocolError) as exc:
        b.recv()
    assert exc.value.reason == reason


def test_preauth_frames_are_tiny() -> None:
    a, b = pair()
    a.sock.sendall(raw_frame(meta_payload(b"{}" + b" " * 5000)))
    with pytest.raises(ProtocolError) as exc:
        b.recv()
    assert exc.value.reason == "oversize"


def test_truncated_frame_times_out_instead_of_blocking() -> None:
    a, b = authed_pair()
    a.sock.sendall(raw_frame(meta_payload(b"{}"))[:7])
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        b.recv(deadline=time.monotonic() + 0.3)
    assert time.monotonic() - t0 < 2


def test_peer_close_mid_frame() -> None:
    a, b = authed_pair()
    a.sock.sendall(raw_frame(meta_payload(b'{"f":{},"a":[]}'))[:-3])
    a.close()
    with pytest.raises(p.PeerClosed):
        b.recv()


def _handshake(server_secret: bytes, client_secret: bytes, client_run: str = "run-1") -> tuple[object, object]:
    s, c = pair()
    out: dict[str, object] = {}

    def serve() -> None:
        try:
            out["hello"] = p.server_handshake(s, server_secret, "run-1", deadline=time.monotonic() + 5)
            p.server_welcome(s, server_secret, {"run_id": "run-1"})
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out["server_error"] = exc

    t = threading.Thread(target=serve)
    t.start()
    try:
        out["welcome"] = p.client_handshake(c, client_secret, run_id=client_run, group=3, workers=4,
                                            deadline=time.monotonic() + 5)
    except Exception as exc:  # noqa: BLE001
        out["client_error"] = exc
    t.join()
    return out.get("server_error"), out.get("client_error") or out.get("welcome")


def test_handshake_with_the_right_secret() -> None:
    server_err, welcome = _handshake(SECRET, SECRET)
    assert server_err is None
    assert isinstance(welcome, p.Message) and welcome.fields["run_id"] == "run-1"


def test_handshake_with_a_wrong_secret_is_refused() -> None:
    server_err, client_result = _handshake(SECRET, b"x" * 32)
    assert isinstance(server_err, ProtocolError) and server_err.reason == "bad_auth"


def test_handshake_for_another_run_is_refused() -> None:
    server_err, _ = _handshake(SECRET, SECRET, client_run="other-run")
    assert isinstance(server_err, ProtocolError) and server_err.reason == "bad_auth"


def test_a_replayed_hello_fails_against_a_fresh_challenge() -> None:
    # Record a valid HELLO from one handshake, then replay it against a new connection.
    s, c = pair()
    recorded: dict[str, object] = {}

    def serve() -> None:
        recorded["hello"] = p.server_handshake(s, SECRET, "run-1", deadline=time.monotonic() + 5)
        p.server_welcome(s, SECRET, {})

    t = threading.Thread(target=serve)
    t.start()
    p.client_handshake(c, SECRET, run_id="run-1", group=0, workers=1, deadline=time.monotonic() + 5)
    t.join()
    hello = recorded["hello"]
    s2, c2 = pair()
    errors: list[Exception] = []

    def serve2() -> None:
        try:
            p.server_handshake(s2, SECRET, "run-1", deadline=time.monotonic() + 5)
        except ProtocolError as exc:
            errors.append(exc)

    t2 = threading.Thread(target=serve2)
    t2.start()
    c2.recv(deadline=time.monotonic() + 5)  # the fresh challenge, ignored by the attacker
    c2.send(MsgType.HELLO, hello.fields)  # type: ignore[attr-defined]
    t2.join()
    assert errors and errors[0].reason == "bad_auth"


def test_all_finite() -> None:
    assert p.all_finite({"a": np.ones(3), "b": np.arange(3)})
    assert not p.all_finite({"a": np.array([1.0, np.nan])})
    assert not p.all_finite({"a": np.array([np.inf], np.float32)})


def test_receive_straight_into_given_arrays_and_fall_back_when_they_do_not_fit() -> None:
    a, b = authed_pair()
    w = {"k": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(4, np.float32)}
    target = {"k": np.zeros((3, 4), np.float32), "b": np.zeros(5, np.float32)}  # "b" has the wrong shape
    a.send(MsgType.WEIGHTS, {"version": 2}, w)
    msg = b.recv(into=lambda t, f: target if t == MsgType.WEIGHTS and f["version"] == 2 else None)
    assert msg.arrays["k"] is target["k"]
    np.testing.assert_array_equal(target["k"], w["k"])
    assert msg.arrays["b"] is not target["b"] and not target["b"].any()
    np.testing.assert_array_equal(msg.arrays["b"], w["b"])
    # A frame type the callback declines is received as usual.
    a.send(MsgType.HEARTBEAT, {}, {"x": np.ones(2)})
    hb = b.recv(into=lambda t, f: target if t == MsgType.WEIGHTS else None)
    assert hb.type == MsgType.HEARTBEAT and hb.arrays["x"].sum() == 2


def test_direct_receive_checks_the_declared_sizes() -> None:
    a, b = authed_pair(max_frame=1 << 20)
    a.sock.sendall(raw_frame(meta_payload(b'{"f": {}, "a": [["k", "f4", [4]]]}', b"\0" * 8)))
    with pytest.raises(ProtocolError) as exc:
        b.recv(into=lambda t, f: {"k": np.zeros(4, np.float32)})
    assert exc.value.reason == "malformed"
