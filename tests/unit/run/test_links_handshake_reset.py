"""A peer that resets between its HELLO and the master's WELCOME is a counted refusal, never a thread's
traceback (issue 25, finding 9).

Real sockets and the real handshake: the peer answers the challenge correctly, then closes with an RST
(``SO_LINGER`` 0) while the master's ``on_join`` runs, so the WELCOME meets a reset connection. The master
must count ``rejected.handshake_aborted``, undo the join (``on_leave``), keep serving, and no thread may end
with an exception.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from typing import Any

from worker import protocol as p
from worker.links import Counters, GroupLink, LinkServer
from worker.protocol.frames import NONCE_BYTES
from worker.protocol.handshake import _identity, _mac

SECRET = b"r" * 32
RUN = "run-reset"


def _hello_then_reset(port: int, group: int) -> None:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    conn = p.Connection(s, max_frame_bytes=1 << 20, timeout_s=5)
    challenge = conn.recv(deadline=time.monotonic() + 5)
    assert challenge.type == p.MsgType.CHALLENGE
    client_nonce = os.urandom(NONCE_BYTES)
    fields: dict[str, Any] = {"role": "group", "group": group, "workers": 1, "run_id": RUN,
                              "nonce": client_nonce.hex()}
    fields["mac"] = _mac(SECRET, b"hello", bytes.fromhex(challenge.fields["nonce"]), client_nonce, _identity(fields))
    conn.send(p.MsgType.HELLO, fields)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()  # RST, before the WELCOME


def test_a_reset_before_welcome_is_a_counted_refusal_and_no_traceback() -> None:
    crashed: list[str] = []
    old_hook = threading.excepthook
    threading.excepthook = lambda a: crashed.append(f"{a.thread.name if a.thread else '?'}: {a.exc_type.__name__}")
    events: list[tuple[str, int]] = []
    counters = Counters()

    def on_join(link: GroupLink) -> tuple[dict[str, Any], list[Any]]:
        events.append(("join", link.group))
        time.sleep(0.3)  # the peer's RST arrives meanwhile
        return {"run_id": RUN}, []

    lsock = socket.create_server(("127.0.0.1", 0))
    server = LinkServer(lsock, secret=SECRET, run_id=RUN, max_frame_bytes=1 << 20, heartbeat_interval_s=0.2,
                        heartbeat_timeout_s=30, handshake_timeout_s=5, max_connections=8, counters=counters,
                        on_join=on_join, on_message=lambda link, msg: None,
                        on_leave=lambda link, reason: events.append(("leave", link.group)))
    server.start()
    port = lsock.getsockname()[1]
    try:
        for i in range(1, 6):  # one after the other, so each join is undone by its own leave
            _hello_then_reset(port, 3)
            deadline = time.monotonic() + 10
            while counters.snapshot().get("rejected.handshake_aborted", 0) < i and time.monotonic() < deadline:
                time.sleep(0.02)
        time.sleep(0.3)
        assert crashed == [], f"a thread died with a traceback: {crashed}"
        snap = counters.snapshot()
        assert snap.get("rejected.handshake_aborted") == 5, snap
        assert "connections" not in snap  # none counted as a served group
        assert events == [("join", 3), ("leave", 3)] * 5
        assert server.live_links() == []
        # and the server still serves an honest group
        good = p.Connection(socket.create_connection(("127.0.0.1", port), timeout=5), max_frame_bytes=1 << 20,
                            timeout_s=5)
        p.client_handshake(good, SECRET, run_id=RUN, group=3, workers=1, deadline=time.monotonic() + 5)
        good.close()
    finally:
        server.close(drain_s=0.1)
        threading.excepthook = old_hook
