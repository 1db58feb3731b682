"""Transport: a weight broadcast through the project's protocol vs a raw length-prefixed socket vs the
classic pickling ``multiprocessing.Pipe``, measured in the same process on loopback.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import struct
import threading
import time
from statistics import median
from typing import Any

import numpy as np

from worker import protocol as p
from worker.protocol import Connection, MsgType

SECRET = b"b" * 32


def _weights(nbytes: int) -> dict[str, np.ndarray]:
    """A realistic weight dict: a few layers, float32, ``nbytes`` in all."""
    n = nbytes // 4
    sizes = [n // 2, n // 4, n // 8, n - n // 2 - n // 4 - n // 8]
    return {f"layer{i}/kernel": np.random.default_rng(i).standard_normal(s).astype(np.float32) for i, s in enumerate(sizes)}


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    c = socket.create_connection(srv.getsockname())
    s, _ = srv.accept()
    srv.close()
    for x in (c, s):
        x.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s, c


def protocol_once(weights: dict[str, np.ndarray], reps: int) -> list[float]:
    """Send WEIGHTS frames master -> group over an authenticated connection; time each until decoded."""
    s, c = _tcp_pair()
    server = Connection(s, max_frame_bytes=1 << 30, timeout_s=30)
    client = Connection(c, max_frame_bytes=1 << 30, timeout_s=30)
    t = threading.Thread(target=lambda: (p.server_handshake(server, SECRET, "bench", deadline=time.monotonic() + 10),
                                         p.server_welcome(server, SECRET, {})))
    t.start()
    p.client_handshake(client, SECRET, run_id="bench", group=0, workers=1, deadline=time.monotonic() + 10)
    t.join()
    times = []
    live = {k: np.empty_like(a) for k, a in weights.items()}  # the group's policy arrays, double-buffered
    spare = {k: np.empty_like(a) for k, a in weights.items()}
    for v in range(reps):
        parts = p.encode_parts(MsgType.WEIGHTS, {"version": v}, weights)  # encoded once per version, as the master does
        _ = parts.digest  # and hashed once per version (the payload hash under each connection's MAC), as it does
        t0 = time.perf_counter()
        sender = threading.Thread(target=server.send_parts, args=(parts,))
        sender.start()
        # What a worker group does: receive straight into the spare set, check it, swap it in.
        msg = client.recv(reuse_buffer=True, into=lambda t, f: spare)
        assert all(msg.arrays[k] is spare[k] for k in spare)  # names and shapes fitted; finiteness is the master's check
        live, spare = spare, live
        times.append(time.perf_counter() - t0)
        sender.join()
    server.close()
    client.close()
    return times


def raw_once(weights: dict[str, np.ndarray], reps: int) -> list[float]:
    """The floor: one preallocated buffer, 4-byte length prefix, sendall / recv_into a memoryview."""
    s, c = _tcp_pair()
    payload = np.concatenate([w.ravel() for w in weights.values()]).view(np.uint8)
    buf = np.empty(payload.nbytes, np.uint8)
    view = memoryview(buf)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        sender = threading.Thread(target=lambda: (s.sendall(struct.pack("!I", payload.nbytes)), s.sendall(payload)))
        sender.start()
        head = c.recv(4, socket.MSG_WAITALL)
        n = struct.unpack("!I", head)[0]
        got = 0
        while got < n:
            got += c.recv_into(view[got:], n - got)
        times.append(time.perf_counter() - t0)
        sender.join()
    s.close()
    c.close()
    return times


def _pipe_child(conn: Any, reps: int) -> None:
    for _ in range(reps):
        conn.recv()
        conn.send(b"ok")


def pipe_once(weights: dict[str, np.ndarray], reps: int) -> list[float]:
    """The classic recipe: ``multiprocessing.Pipe`` and pickle (round trip minus the tiny ack)."""
    ctx = mp.get_context("fork")
    a, b = ctx.Pipe()
    child = ctx.Process(target=_pipe_child, args=(b, reps))
    child.start()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a.send(weights)
        a.recv()
        times.append(time.perf_counter() - t0)
    child.join()
    return times


def hash_costs(nbytes: int = 20_000_000, reps: int = 15) -> list[dict[str, Any]]:
    """What authenticating every byte of a ``nbytes`` payload costs the receiver, per candidate (medians, ms):
    one memory pass (``np.copyto``, the floor of any function of every byte), the SHA-256 the sealed frames
    use, and the faster keyed hashes where their packages are installed (``pip install -e .[bench]``)."""
    import hashlib
    import os

    buf = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst, view, key = np.empty_like(buf), memoryview(buf), os.urandom(32)
    candidates: dict[str, Any] = {
        "one memory pass (memcpy)": lambda: np.copyto(dst, buf),
        "SHA-256 (hashlib; the protocol's payload hash)": lambda: hashlib.sha256(view).digest(),
        "BLAKE2b keyed (hashlib)": lambda: hashlib.blake2b(view, key=key).digest(),
    }
    try:
        import blake3

        candidates["BLAKE3 keyed, 1 thread (blake3)"] = lambda: blake3.blake3(view, key=key).digest()
        candidates["BLAKE3 keyed, every core (blake3)"] = \
            lambda: blake3.blake3(view, key=key, max_threads=blake3.blake3.AUTO).digest()
    except ImportError:
        pass
    try:
        from cryptography.hazmat.primitives.poly1305 import Poly1305

        candidates["Poly1305 (cryptography)"] = lambda: Poly1305.generate_tag(key, view)
    except ImportError:
        pass
    rows = []
    for name, f in candidates.items():
        f()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            f()
            times.append(time.perf_counter() - t0)
        ms = median(times) * 1e3
        rows.append({"what": name, "bytes": nbytes, "ms": ms, "gb_s": nbytes / ms / 1e6})
    return rows


def run(reps: int = 15) -> list[dict[str, Any]]:
    rows = []
    for label, size in (("100 KB", 100_000), ("20 MB", 20_000_000)):
        w = _weights(size)
        n = reps if size > 1_000_000 else reps * 20
        # Interleave the three so machine noise hits them alike; medians of each.
        proto, raw, pipe = [], [], []
        for _ in range(3):
            raw += raw_once(w, n)
            proto += protocol_once(w, n)
            pipe += pipe_once(w, n)
        r, pr, pi = median(raw), median(proto), median(pipe)
        rows.append({"size": label, "bytes": size, "raw_ms": r * 1e3, "protocol_ms": pr * 1e3, "pipe_ms": pi * 1e3,
                     "protocol_gb_s": size / pr / 1e9, "raw_gb_s": size / r / 1e9, "pipe_gb_s": size / pi / 1e9,
                     "protocol_vs_raw": r / pr, "protocol_vs_pipe": pi / pr})
    return rows


if __name__ == "__main__":
    for row in run():
        print(row)
