"""Master-side connections to worker groups: the accept loop, the handshake and one reader and one
writer thread per authenticated group.

Every frame a peer sends ends as a message for the learner or as a ``rejected.<reason>`` counter and
one log line, never as a traceback: a decoder that raised anything but ``ProtocolError`` is a bug, and
it is still counted (``rejected.malformed``) rather than killing the peer's thread.

Why threads and blocking sockets: each peer gets its own reader, so a slow, silent or hostile peer can
only stall itself (it times out), and the learner never blocks on a socket because every send goes
through the link's bounded outbox. Frames are read into a fresh ``np.empty`` buffer and decoded as
views, so a 20 MB weight frame is copied once, by the kernel.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from worker.contract import LISTEN_FD_ENV
from worker.protocol import (Connection, Message, MsgType, PeerClosed, ProtocolError, encode_parts,
                             server_handshake, server_welcome)

log = logging.getLogger(__name__)


def listening_socket(host: str, port: int) -> socket.socket:
    """The master's listening socket: the one the process backend bound and passed down (``LISTEN_FD_ENV``, so
    groups could dial at once), else a new one on ``(host, port)`` (IPv6 when ``host`` has a colon)."""
    fd = os.environ.pop(LISTEN_FD_ENV, None)
    if fd is not None:
        return socket.socket(fileno=int(fd))
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(128)
    return s


class Counters:
    """Thread-safe named counters (rejected frames by reason, connections, ...)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: collections.Counter[str] = collections.Counter()

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._c[key] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._c)


@dataclass(eq=False)
class GroupLink:
    """One authenticated worker-group connection."""

    conn: Connection
    group: int
    workers: int
    outbox: "queue.Queue[list[Any] | None]" = field(default_factory=lambda: queue.Queue(maxsize=8))
    connected_at: float = field(default_factory=time.monotonic)
    last_send: float = field(default_factory=time.monotonic)
    alive: bool = True
    sent_version: int = -1  # the weights version last posted to this group (a reply repeats no weights it has)

    def post(self, parts: list[Any]) -> bool:
        """Queue a frame for sending; a peer too slow to drain 8 frames is dropped."""
        if not self.alive:
            return False
        try:
            self.outbox.put_nowait(parts)
            return True
        except queue.Full:
            log.warning("group %d is not reading its frames; dropping the connection", self.group)
            self.close()
            return False

    def close(self) -> None:
        if self.alive:
            self.alive = False
            try:
                self.outbox.put_nowait(None)
            except queue.Full:
                pass
            self.conn.close()


class LinkServer:
    """Accepts worker groups on a listening socket and feeds their messages to ``on_message``.

    Args:
        sock: a bound, listening socket.
        secret: the run secret.
        run_id: the run id (a group of another run is refused).
        on_join: called with a new link after authentication; returns the frames to send first
            (WELCOME info dict; SETUP and initial weights frames).
        on_message: called from the link's reader thread with (link, message) for a payload (TRAJ) or a BYE
            that carries an error.
        on_leave: called when a group leaves: its link closes and no newer link of that group replaced it
            (a group that rejoined before its old link timed out has not left).
        counters: where rejections are counted (``rejected.<reason>``).
    """

    def __init__(self, sock: socket.socket, *, secret: bytes, run_id: str, max_frame_bytes: int,
                 heartbeat_interval_s: float, heartbeat_timeout_s: float, handshake_timeout_s: float,
                 max_connections: int, counters: Counters,
                 on_join: Callable[[GroupLink], tuple[dict[str, Any], list[Any]]],
                 on_message: Callable[[GroupLink, Message], None],
                 on_leave: Callable[[GroupLink, str], None]) -> None:
        self.sock = sock
        self.secret = secret
        self.run_id = run_id
        self.max_frame_bytes = max_frame_bytes
        self.hb_interval = heartbeat_interval_s
        self.hb_timeout = heartbeat_timeout_s
        self.handshake_timeout = handshake_timeout_s
        self.max_connections = max_connections
        self.counters = counters
        self.on_join, self.on_message, self.on_leave = on_join, on_message, on_leave
        self.links: dict[int, GroupLink] = {}
        self._lock = threading.Lock()
        # Held while a group's link is registered and ``on_join`` runs, and while a link is dropped and
        # ``on_leave`` runs: the callbacks of one group then arrive in the order the links came and went, so
        # an old link's leave can never land after a newer link's join (status would say "connecting").
        self._membership = threading.Lock()
        self._open = 0
        self._stopping = threading.Event()
        self._heartbeat = encode_parts(MsgType.HEARTBEAT, {})

    def start(self) -> None:
        self.sock.settimeout(0.5)
        threading.Thread(target=self._accept_loop, name="accept", daemon=True).start()
        threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True).start()

    def live_links(self) -> list[GroupLink]:
        with self._lock:
            return [link for link in self.links.values() if link.alive]

    def broadcast_stop(self, reason: str) -> None:
        frame = encode_parts(MsgType.STOP, {"reason": reason})
        for link in self.live_links():
            link.post(frame)

    def close(self, drain_s: float = 2.0) -> None:
        """Stop accepting, give outboxes up to ``drain_s`` to flush (STOP frames), close every link."""
        self._stopping.set()
        deadline = time.monotonic() + drain_s
        for link in self.live_links():
            while not link.outbox.empty() and time.monotonic() < deadline:
                time.sleep(0.01)
            link.close()
        try:
            self.sock.close()
        except OSError:
            pass

    # -- threads
    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                s, addr = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                if not self._stopping.is_set():
                    log.exception("accept failed")
                return
            with self._lock:
                if self._open >= self.max_connections:
                    self.counters.add("rejected.too_many_connections")
                    s.close()
                    continue
                self._open += 1
            peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else "unix"
            threading.Thread(target=self._serve, args=(s,), name=f"peer-{peer}", daemon=True).start()

    def _heartbeat_loop(self) -> None:
        while not self._stopping.wait(self.hb_interval / 2):
            now = time.monotonic()
            for link in self.live_links():
                if link.outbox.empty() and now - link.last_send >= self.hb_interval:
                    link.post(self._heartbeat)

    def _serve(self, s: socket.socket) -> None:
        conn = Connection(s, max_frame_bytes=self.max_frame_bytes, timeout_s=self.hb_timeout)
        link: GroupLink | None = None
        reason = "closed"
        try:
            try:
                hello = server_handshake(conn, self.secret, self.run_id,
                                         deadline=time.monotonic() + self.handshake_timeout)
            except ProtocolError as exc:
                self._reject(conn, exc.reason, exc.detail)
                return
            except TimeoutError:
                self._reject(conn, "handshake_timeout", f"no complete handshake within {self.handshake_timeout:g} s")
                return
            except (PeerClosed, OSError) as exc:
                self._reject(conn, "handshake_aborted", str(exc))
                return
            except Exception as exc:  # a decode path missed a case: still a counted refusal, not a dead thread
                self._reject(conn, "malformed", f"{type(exc).__name__}: {str(exc)[:120]}")
                return
            link = GroupLink(conn=conn, group=int(hello.fields["group"]), workers=int(hello.fields["workers"]))
            refused: str | None = None
            with self._membership:  # a join and an older link's leave of one group never interleave
                with self._lock:
                    old = self.links.get(link.group)
                    self.links[link.group] = link
                try:
                    info, first_frames = self.on_join(link)
                except ValueError as exc:
                    with self._lock:
                        if self.links.get(link.group) is link:
                            if old is not None and old.alive:
                                self.links[link.group] = old
                            else:
                                del self.links[link.group]
                    refused = str(exc)
            if refused is not None:
                self._reject(conn, "unknown_group", refused)
                link = None
                return
            if old is not None and old.alive:
                log.info("group %d reconnected; closing its previous connection", link.group)
                old.close()
            try:
                server_welcome(conn, self.secret, info)
            except Exception as exc:  # noqa: BLE001 - reset, closed, timed out (OSError) or a bug: one refusal
                # The peer left between its HELLO and our WELCOME (a group dropping mid-handshake, or a hostile
                # peer): counted like any other aborted handshake; ``finally`` undoes the join.
                aborted = isinstance(exc, (PeerClosed, OSError))
                self.counters.add("rejected.handshake_aborted" if aborted else "rejected.malformed")
                log.warning("refused connection from %s: %s before its WELCOME (%s: %.120s)", conn.peer,
                            "handshake_aborted" if aborted else "malformed", type(exc).__name__, exc)
                reason = "handshake aborted before WELCOME"
                return
            threading.Thread(target=self._writer, args=(link,), name=f"send-g{link.group}", daemon=True).start()
            for frame in first_frames:
                link.post(frame)
            self.counters.add("connections")
            reason = self._read_loop(link)
        finally:
            with self._membership:
                with self._lock:
                    self._open -= 1
                    current = link is not None and self.links.get(link.group) is link
                    if current and link is not None:
                        del self.links[link.group]
                if link is not None:
                    link.close()
                    if current:
                        self.on_leave(link, reason)
                    else:  # the group rejoined on a newer link (its node was lost): that link speaks for it
                        log.info("group %d: its previous connection ended (%s); the newer one serves it",
                                 link.group, reason)
                else:
                    conn.close()

    def _read_loop(self, link: GroupLink) -> str:
        conn = link.conn
        while link.alive and not self._stopping.is_set():
            try:
                msg = conn.recv()
            except ProtocolError as exc:
                self.counters.add(f"rejected.{exc.reason}")
                log.warning("group %d sent a bad frame (%s); closing its connection", link.group, exc)
                return f"protocol error: {exc.reason}"
            except TimeoutError:
                self.counters.add("timeouts")
                log.warning("group %d silent for %.0f s; closing its connection", link.group, self.hb_timeout)
                return "heartbeat timeout"
            except (PeerClosed, OSError) as exc:
                return f"disconnected: {exc}" if link.alive else "closed"
            except Exception as exc:  # a decode path missed a case: still a counted refusal, not a traceback
                self.counters.add("rejected.malformed")
                log.warning("group %d sent a frame that failed to decode (%s: %.120s); closing its connection",
                            link.group, type(exc).__name__, exc)
                return "protocol error: malformed"
            if msg.type == MsgType.HEARTBEAT:
                continue
            if msg.type == MsgType.BYE:
                if msg.fields.get("error"):  # the group's algorithm code raised: the master ends the run
                    self.on_message(link, msg)
                return "yielded" if msg.fields.get("reason") == "yield" else "bye"
            if msg.type == MsgType.TRAJ:
                self.on_message(link, msg)
                continue
            self.counters.add("rejected.unexpected_type")
            log.warning("group %d sent unexpected %s; closing its connection", link.group, msg.type.name)
            return f"unexpected {msg.type.name}"
        return "closed"

    def _writer(self, link: GroupLink) -> None:
        while True:
            parts = link.outbox.get()
            if parts is None or not link.alive:
                return
            try:
                link.conn.send_parts(parts)
                link.last_send = time.monotonic()
            except (OSError, TimeoutError) as exc:
                log.warning("sending to group %d failed (%s); closing its connection", link.group, exc)
                link.close()
                return

    def _reject(self, conn: Connection, reason: str, detail: str) -> None:
        self.counters.add(f"rejected.{reason}")
        log.warning("refused connection from %s: %s (%s)", conn.peer, reason, detail)
        if reason in ("bad_auth", "bad_version", "bad_handshake", "unknown_group"):
            try:  # say why without echoing anything the peer sent
                conn.send(MsgType.REJECT, {"reason": "authentication failed" if reason == "bad_auth" else reason})
            except OSError:
                pass
        conn.close()
