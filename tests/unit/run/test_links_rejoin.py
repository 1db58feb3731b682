"""A group that rejoins before its old connection ends has not left (issue 16, defect 1).

On a lost node the old TCP connection sees no FIN: the group's service is rescheduled elsewhere and
joins again while the master still holds the old link. The master then closes the old link, and that
close used to report the group as gone (``group_left`` after ``group_joined``), so status said
``connecting`` for the rest of the run while the group trained. Real sockets, real handshakes.
"""

from __future__ import annotations

import socket
import threading
import time

from worker import protocol as p
from worker.links import Counters, GroupLink, LinkServer

SECRET = b"k" * 32
RUN = "run-rejoin"


def _server(events: list[tuple[str, int, int]]) -> tuple[LinkServer, int]:
    lsock = socket.create_server(("127.0.0.1", 0))
    seen: list[GroupLink] = []  # held, so a closed link's id() is never reused by a newer one

    def key(link: GroupLink) -> int:
        for i, known in enumerate(seen):
            if known is link:
                return i
        seen.append(link)
        return len(seen) - 1

    server = LinkServer(lsock, secret=SECRET, run_id=RUN, max_frame_bytes=1 << 20, heartbeat_interval_s=0.2,
                        heartbeat_timeout_s=30, handshake_timeout_s=5, max_connections=8, counters=Counters(),
                        on_join=lambda link: (events.append(("join", link.group, key(link))) or ({"run_id": RUN}, [])),
                        on_message=lambda link, msg: None,
                        on_leave=lambda link, reason: events.append(("leave", link.group, key(link))))
    server.start()
    return server, lsock.getsockname()[1]


def _join(port: int, group: int) -> p.Connection:
    conn = p.Connection(socket.create_connection(("127.0.0.1", port), timeout=5), max_frame_bytes=1 << 20,
                        timeout_s=5)
    p.client_handshake(conn, SECRET, run_id=RUN, group=group, workers=1, deadline=time.monotonic() + 5)
    return conn


def _wait(pred, timeout: float = 10) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_the_old_links_close_after_a_rejoin_is_not_a_leave() -> None:
    events: list[tuple[str, int, int]] = []
    server, port = _server(events)
    try:
        first = _join(port, 0)  # stays open, as a connection to a lost node does
        _wait(lambda: len(server.live_links()) == 1)
        second = _join(port, 0)
        _wait(lambda: events[-1:] == [("join", 0, 1)])
        time.sleep(0.5)  # the server closes the first link; its reader thread ends
        assert ("leave", 0, 0) not in events, f"the superseded link reported a leave: {events}"
        assert [link.alive for link in server.live_links()] == [True] and len(server.live_links()) == 1
        second.close()  # now the group really goes
        _wait(lambda: ("leave", 0, 1) in events)
        assert events == [("join", 0, 0), ("join", 0, 1), ("leave", 0, 1)]
        first.close()
    finally:
        server.close(drain_s=0.1)


def test_a_group_that_left_before_it_rejoined_is_reported_both_times() -> None:
    events: list[tuple[str, int, int]] = []
    server, port = _server(events)
    try:
        _join(port, 1).close()
        _wait(lambda: ("leave", 1, 0) in events)
        third = _join(port, 1)
        _wait(lambda: ("join", 1, 1) in events)
        assert events == [("join", 1, 0), ("leave", 1, 0), ("join", 1, 1)]
        third.close()
    finally:
        server.close(drain_s=0.1)


def test_another_groups_link_does_not_hide_a_leave() -> None:
    events: list[tuple[str, int, int]] = []
    server, port = _server(events)
    try:
        a, b = _join(port, 0), _join(port, 1)
        _wait(lambda: len(server.live_links()) == 2)
        a.close()
        _wait(lambda: ("leave", 0, 0) in events)
        b.close()
        _wait(lambda: ("leave", 1, 1) in events)
    finally:
        server.close(drain_s=0.1)
    assert threading.active_count() < 50


def test_a_slow_leave_of_the_old_link_lands_before_the_rejoin() -> None:
    """The old link's leave and the new link's join race on two threads: the leave (slowed here, as a
    metrics write on a busy disk is) must land first, or the group reads as gone while it trains."""
    events: list[tuple[str, int]] = []
    leaving = threading.Event()

    def on_leave(link: GroupLink, reason: str) -> None:
        leaving.set()
        time.sleep(0.5)
        events.append(("leave", link.group))

    lsock = socket.create_server(("127.0.0.1", 0))
    server = LinkServer(lsock, secret=SECRET, run_id=RUN, max_frame_bytes=1 << 20, heartbeat_interval_s=0.2,
                        heartbeat_timeout_s=30, handshake_timeout_s=5, max_connections=8, counters=Counters(),
                        on_join=lambda link: (events.append(("join", link.group)) or ({"run_id": RUN}, [])),
                        on_message=lambda link, msg: None, on_leave=on_leave)
    server.start()
    try:
        _join(lsock.getsockname()[1], 2).close()
        assert leaving.wait(5), "the first link's leave never started"
        second = _join(lsock.getsockname()[1], 2)  # joins while the leave is still running
        _wait(lambda: len(events) == 3)
        assert events == [("join", 2), ("leave", 2), ("join", 2)], events
        second.close()
    finally:
        server.close(drain_s=0.1)
