"""Hostile input on the wire (issue 14 items 2 and 4): every malformed handshake or frame is a counted
``ProtocolError``, never another exception; frames after the handshake are sealed per connection.

Real sockets (socketpairs and loopback TCP), real handshakes, a real worker group; the hostile side is
hand-built bytes.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from typing import Any, Callable

import numpy as np
import pytest

from worker import protocol as p
from worker.contract import GroupAssignment, RunSpec
from worker.protocol import Connection, MsgType, ProtocolError
from worker.protocol.session import Session, derive_keys

SECRET = b"s" * 32
HUGE_SHAPE = [0, 2**31 - 1, 2**31 - 1]  # no bytes, but numpy calls it "too big"


def pair(max_frame: int = 1 << 26) -> tuple[Connection, Connection]:
    a, b = socket.socketpair()
    return Connection(a, max_frame_bytes=max_frame, timeout_s=5), Connection(b, max_frame_bytes=max_frame, timeout_s=5)


def handshaken(run_id: str = "run-1") -> tuple[Connection, Connection]:
    """(master side, group side) after a real handshake: both have a session."""
    s, c = pair()
    t = threading.Thread(target=lambda: (p.server_handshake(s, SECRET, run_id, deadline=time.monotonic() + 5),
                                         p.server_welcome(s, SECRET, {"run_id": run_id})))
    t.start()
    p.client_handshake(c, SECRET, run_id=run_id, group=0, workers=1, deadline=time.monotonic() + 5)
    t.join()
    assert s.session is not None and c.session is not None
    return s, c


def frame_bytes(mtype: int, meta: dict[str, Any], tail: bytes = b"", *, flags: int = 0) -> bytes:
    m = json.dumps(meta).encode()
    payload = struct.pack("!I", len(m)) + m + tail
    return p.HEADER.pack(p.MAGIC, p.PROTOCOL_VERSION, mtype, flags, len(payload)) + payload


def sealed_bytes(session: Session, mtype: int, fields: dict[str, Any], arrays: dict[str, np.ndarray] | None = None) -> bytes:
    """A frame exactly as ``Connection.send_parts`` would put it on the wire with ``session``."""
    frame = p.encode_parts(MsgType(mtype), fields, arrays)
    raw = b"".join(bytes(x) for x in frame)
    header = p.HEADER.pack(p.MAGIC, p.PROTOCOL_VERSION, mtype, p.frames.FLAG_SEALED, len(raw) - p.HEADER_SIZE)
    return header + raw[p.HEADER_SIZE:] + session.seal(header, frame.digest)


def serve_once(handler: Callable[[Connection], None]) -> tuple[socket.socket, threading.Thread]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)

    def loop() -> None:
        srv.settimeout(10)
        while True:
            try:
                s, _ = srv.accept()
            except OSError:
                return
            conn = Connection(s, max_frame_bytes=1 << 26, timeout_s=5)
            try:
                handler(conn)
            except Exception:  # noqa: BLE001 - the fake master's own errors are not under test
                pass
            finally:
                conn.close()

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return srv, t


# ------------------------------------------------------------------------------------ the master's side


@pytest.mark.parametrize("mac", ["é" * 64, "zz" * 32, "ab", 12345, None, ["x"]])
def test_a_hello_with_a_malformed_mac_is_a_protocol_error(mac: Any) -> None:
    s, c = pair()
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            p.server_handshake(s, SECRET, "run-1", deadline=time.monotonic() + 5)
        except BaseException as exc:  # noqa: BLE001 - TypeError here was the bug
            errors.append(exc)

    t = threading.Thread(target=serve)
    t.start()
    c.recv(deadline=time.monotonic() + 5)
    c.send(MsgType.HELLO, {"role": "group", "group": 0, "workers": 1, "run_id": "run-1", "nonce": "00" * 32, "mac": mac})
    t.join()
    assert len(errors) == 1 and isinstance(errors[0], ProtocolError), errors
    assert errors[0].reason == "bad_handshake"


@pytest.mark.parametrize("shape", [HUGE_SHAPE, [2**31 - 1, 2**31 - 1, 0, 5], [1, 0, 2**31 - 1, 2**31 - 1, 2**31 - 1]])
def test_a_shape_numpy_calls_too_big_is_malformed_on_every_decode_path(shape: list[int]) -> None:
    body = frame_bytes(MsgType.HELLO, {"f": {}, "a": [["x", "f4", shape]]})
    a, b = pair()
    a.sock.sendall(body)
    with pytest.raises(ProtocolError) as exc:
        b.recv()
    assert exc.value.reason == "malformed"
    a.sock.sendall(body)  # the receive-into path a group uses for WEIGHTS
    with pytest.raises(ProtocolError) as exc:
        b.recv(into=lambda t, f: {})
    assert exc.value.reason == "malformed"


# ------------------------------------------------------------------------------------- the group's side


@pytest.mark.parametrize("nonce", ["zz" * 32, "00" * 8, "é" * 64, 7, None])
def test_a_malformed_challenge_is_a_protocol_error(nonce: Any) -> None:
    s, c = pair()
    s.send(MsgType.CHALLENGE, {"nonce": nonce, "protocol": p.PROTOCOL_VERSION, "run_id": "run-1"})
    with pytest.raises(ProtocolError) as exc:
        p.client_handshake(c, SECRET, run_id="run-1", group=0, workers=1, deadline=time.monotonic() + 5)
    assert exc.value.reason == "bad_handshake"


def test_the_group_reads_the_welcome_with_the_preauth_limit() -> None:
    # A 900 KB WELCOME used to be read in full before its MAC was checked.
    s, c = pair()

    def serve() -> None:
        p.server_handshake(s, SECRET, "run-1", deadline=time.monotonic() + 5)
        try:
            s.send(MsgType.WELCOME, {"mac": "00" * 32, "pad": "x" * 900_000})
        except OSError:
            pass

    t = threading.Thread(target=serve)
    t.start()
    with pytest.raises(ProtocolError) as exc:
        p.client_handshake(c, SECRET, run_id="run-1", group=0, workers=1, deadline=time.monotonic() + 5)
    c.close()
    t.join()
    assert exc.value.reason == "oversize"


@pytest.mark.parametrize("mac", ["é" * 64, "00" * 32, None])
def test_a_welcome_with_a_bad_mac_is_refused(mac: Any) -> None:
    s, c = pair()
    t = threading.Thread(target=lambda: (p.server_handshake(s, SECRET, "run-1", deadline=time.monotonic() + 5),
                                         s.send(MsgType.WELCOME, {"mac": mac})))
    t.start()
    with pytest.raises(ProtocolError) as exc:
        p.client_handshake(c, SECRET, run_id="run-1", group=0, workers=1, deadline=time.monotonic() + 5)
    t.join()
    assert exc.value.reason == "bad_auth" and c.session is None


# ---------------------------------------------------------------------------------- sealed frames


def test_frames_after_the_handshake_are_sealed_and_round_trip() -> None:
    s, c = handshaken()
    big = np.random.default_rng(0).standard_normal(3_000_000).astype(np.float32)  # 12 MB: several hash pieces
    t = threading.Thread(target=s.send, args=(MsgType.WEIGHTS, {"version": 1}, {"w": big}))
    t.start()
    spare = {"w": np.empty_like(big)}
    msg = c.recv(into=lambda ty, f: spare)
    t.join()
    assert msg.arrays["w"] is spare["w"]
    np.testing.assert_array_equal(spare["w"], big)
    c.send(MsgType.TRAJ, {"version": 1}, {"x": np.arange(5)})
    assert s.recv().fields == {"version": 1}
    assert (s.session.send_seq, s.session.recv_seq) == (1, 1)  # type: ignore[union-attr]


def test_an_unsealed_frame_on_an_authenticated_connection_is_refused() -> None:
    s, c = handshaken()
    c.sock.sendall(p.encode(MsgType.TRAJ, {"version": 0}))  # what an injector without the keys can send
    with pytest.raises(ProtocolError) as exc:
        s.recv()
    assert exc.value.reason == "unsealed"


@pytest.mark.parametrize("where", ["payload", "header_type", "trailer_tag"])
def test_an_altered_frame_is_refused(where: str) -> None:
    s, c = handshaken()
    data = bytearray(sealed_bytes(c.session, MsgType.TRAJ, {"version": 0}, {"x": np.arange(8, dtype=np.int64)}))  # type: ignore[arg-type]
    if where == "payload":
        data[-60] ^= 1
    elif where == "header_type":
        data[5] = MsgType.GRADS
    else:
        data[-1] ^= 1
    c.sock.sendall(bytes(data))
    with pytest.raises(ProtocolError) as exc:
        s.recv()
    assert exc.value.reason == "bad_mac"


def test_a_replayed_or_reordered_frame_is_refused() -> None:
    s, c = handshaken()
    first = sealed_bytes(c.session, MsgType.TRAJ, {"n": 1})  # type: ignore[arg-type]
    second = sealed_bytes(c.session, MsgType.TRAJ, {"n": 2})  # type: ignore[arg-type]
    c.sock.sendall(first)
    assert s.recv().fields == {"n": 1}
    c.sock.sendall(first)  # replay
    with pytest.raises(ProtocolError) as exc:
        s.recv()
    assert exc.value.reason == "replayed"
    s2, c2 = handshaken()
    first = sealed_bytes(c2.session, MsgType.TRAJ, {"n": 1})  # type: ignore[arg-type]
    second = sealed_bytes(c2.session, MsgType.TRAJ, {"n": 2})  # type: ignore[arg-type]
    c2.sock.sendall(second + first)  # reordered
    with pytest.raises(ProtocolError) as exc:
        s2.recv()
    assert exc.value.reason == "replayed"


def test_a_frame_from_another_connection_is_refused() -> None:
    s1, c1 = handshaken()
    s2, c2 = handshaken()
    c2.sock.sendall(sealed_bytes(c1.session, MsgType.TRAJ, {"n": 1}))  # type: ignore[arg-type]
    with pytest.raises(ProtocolError) as exc:
        s2.recv()
    assert exc.value.reason == "bad_mac"


def test_session_keys_differ_per_connection_and_direction() -> None:
    a = derive_keys(SECRET, b"\1" * 32, b"\2" * 32, "run-1")
    b = derive_keys(SECRET, b"\1" * 32, b"\3" * 32, "run-1")
    c = derive_keys(SECRET, b"\1" * 32, b"\2" * 32, "run-2")
    assert len({*a, *b, *c}) == 6


# ------------------------------------------------------------------------- a real group, a hostile master


def _spec(port: int) -> RunSpec:
    return RunSpec(run_id="run-1", env_id="CartPole-v1", algo="ppo", master_port=port, groups=(GroupAssignment(0, 1),),
                   handshake_timeout_s=1.0, heartbeat_timeout_s=1.0)


def test_a_malformed_challenge_does_not_escape_the_groups_reconnect_loop() -> None:
    from worker.group import EXIT_MASTER_GONE, WorkerGroup

    def bad_challenge(conn: Connection) -> None:
        conn.send(MsgType.CHALLENGE, {"nonce": "not hex", "protocol": p.PROTOCOL_VERSION})
        time.sleep(0.1)

    srv, _ = serve_once(bad_challenge)
    port = srv.getsockname()[1]
    group = WorkerGroup(_spec(port), 0, SECRET, ("127.0.0.1", port), reconnect_deadline_s=1.0)
    try:
        assert group.run() == EXIT_MASTER_GONE
    finally:
        srv.close()
    assert group.rejected["bad_handshake"] >= 2  # it retried, counting each


@pytest.mark.parametrize("attack", ["huge_shape", "no_version", "unsealed"])
def test_hostile_weights_make_the_group_reconnect_not_crash(attack: str) -> None:
    from worker.group import EXIT_STOPPED, WorkerGroup

    served = {"n": 0}

    def master(conn: Connection) -> None:
        p.server_handshake(conn, SECRET, "run-1", deadline=time.monotonic() + 5)
        p.server_welcome(conn, SECRET, {"run_id": "run-1"})
        served["n"] += 1
        if served["n"] == 1:
            if attack == "huge_shape":
                data = frame_bytes(MsgType.WEIGHTS, {"f": {"version": 2}, "a": [["w", "f4", HUGE_SHAPE]]})
                payload = data[p.HEADER_SIZE:]
                header = p.HEADER.pack(p.MAGIC, p.PROTOCOL_VERSION, MsgType.WEIGHTS, p.frames.FLAG_SEALED, len(payload))
                conn.sock.sendall(header + payload + conn.session.seal(header, p.frames.PAYLOAD_HASH(payload).digest()))  # type: ignore[union-attr]
            elif attack == "no_version":
                conn.send(MsgType.WEIGHTS, {"version": "x"}, {})
            else:
                conn.sock.sendall(p.encode(MsgType.WEIGHTS, {"version": 1}))
            time.sleep(0.5)
        else:
            conn.send(MsgType.STOP, {"reason": "done"})
            time.sleep(0.2)

    srv, _ = serve_once(master)
    port = srv.getsockname()[1]
    group = WorkerGroup(_spec(port), 0, SECRET, ("127.0.0.1", port), reconnect_deadline_s=5.0)
    try:
        assert group.run() == EXIT_STOPPED
    finally:
        srv.close()
    assert served["n"] == 2 and sum(group.rejected.values()) >= 1, group.rejected


def test_a_group_whose_secret_is_refused_exits_with_the_contracts_code() -> None:
    """The supervisor does not restart a group that exits GROUP_AUTH_REFUSED_EXIT (nor spend its budget:
    tests/unit/host/test_supervisor.py), so the group must exit with exactly it, at once, when the master refuses
    its secret."""
    from worker.contract import GROUP_AUTH_REFUSED_EXIT
    from worker.group import WorkerGroup
    from worker.protocol.handshake import server_handshake

    def master_with_another_secret(conn: Connection) -> None:
        try:
            server_handshake(conn, b"another secret, not the group's", "run-1", deadline=time.monotonic() + 5)
        except ProtocolError as exc:  # what worker.links does with a peer that fails the handshake
            conn.send(MsgType.REJECT, {"reason": "authentication failed" if exc.reason == "bad_auth" else exc.reason})

    srv, _ = serve_once(master_with_another_secret)
    port = srv.getsockname()[1]
    group = WorkerGroup(_spec(port), 0, SECRET, ("127.0.0.1", port), reconnect_deadline_s=30.0)
    try:
        t0 = time.monotonic()
        assert group.run() == GROUP_AUTH_REFUSED_EXIT
        assert time.monotonic() - t0 < 10, "refused once is enough: no reconnecting"
    finally:
        srv.close()
