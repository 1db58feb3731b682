"""The GPU lease broker: root takes every lease, so the per-user cap is enforced, not requested.

``launcher admin broker`` runs this as root (under systemd, or a test). It listens on the Unix socket the site
file names (``broker = "/run/launcher/broker.sock"``; directory root 0755, socket 0666) and is ONE thread: a
``selectors`` loop over the listening socket, the open client connections and a pidfd per process that keeps a
lease alive. Because nothing else runs while a request is handled, "count the caller's leases, check the cap,
take the locks" is one atomic step: two launchers of one user asking at the same moment are served one after
the other, and the second sees the first's lease.

* **The locks are the broker's.** It holds the exclusive ``flock`` on each leased GPU's lease file with its own
  descriptor. With a broker the lease files are root 0600 (``launcher admin init --broker``), so no user can
  open, hence lock, one; the kernel's lock table (``/proc/locks``) names the broker as the holder, and the
  broker's holder note (``holders/<UUID>@<broker pid>.json``, root's, ``"broker": true``) says for whom.
* **Who asks comes from the kernel.** The caller's uid and pid are the socket's ``SO_PEERCRED``, never the
  request; the caller is pinned by a pidfd taken at once (``SO_PEERPIDFD``, or ``pidfd_open`` while the
  connection is still open), so a recycled pid cannot inherit a lease.
* **A lease lives as long as its processes.** Each lease is tied to the caller and to any process ``tie`` adds
  (the process backend's master child, a Docker master container's host pid). When every tied process has
  exited (its pidfd turns readable) the broker drops the lock and removes the note.
* **A slow or hostile client cannot stall it.** A request is one JSON line of at most
  :data:`~launcher.gpu.broker_wire.MAX_REQUEST_BYTES`; a connection that has not sent one within
  :data:`REQUEST_DEADLINE_S` is answered with a refusal and closed; one uid may hold at most
  :data:`MAX_CONNECTIONS_PER_UID` connections open.

This module is the daemon: the ``selectors`` loop, its sockets and pidfds, and the start-up checks. The requests
and replies are :mod:`launcher.gpu.broker_wire`; the lease table and its rules (cap, ownership, ties) are
:mod:`launcher.gpu.broker_leases`; the client side is :mod:`launcher.gpu.broker_client`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import selectors
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from launcher.errors import BadInput, ConfigErrors
from launcher.gpu.broker_leases import Lease, LeaseTable, check_tie_uid, lock_lease_file
from launcher.gpu.broker_setup import check_lease_files, listen, remove_stale_notes
from launcher.gpu.broker_wire import (MAX_REQUEST_BYTES, LeaseRequest, ListRequest, Refusal, ReleaseRequest,
                                      TieRequest, encode, parse_request, peer_credentials)
from launcher.gpu.holders import NOTE_MAX_BYTES, proc_info, user_name, write_note
from launcher.gpu.policy import load_site_file
from launcher.gpu.store import Site

log = logging.getLogger(__name__)

REQUEST_DEADLINE_S = 2.0  # a connection must send its whole request line within this
MAX_CONNECTIONS_PER_UID = 16  # open connections one uid may hold at once; more are refused at once
_SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux 6.5+; Python 3.11 has no name for it
_LISTEN = "listen"


class _Stop(Exception):
    """SIGTERM or SIGINT: leave the loop."""


@dataclass
class _Conn:
    sock: socket.socket
    pid: int
    uid: int
    pidfd: int | None  # the caller, pinned; None when it was already gone
    deadline: float
    buf: bytearray = field(default_factory=bytearray)


def _exited(pidfd: int) -> bool:
    """Whether the process behind ``pidfd`` has exited (a pidfd polls readable then)."""
    return bool(select.select([pidfd], [], [], 0)[0])


class Broker:
    """The broker's state and its loop. ``serve`` runs it; tests may build one and call ``serve`` in a process."""

    def __init__(self, site: Site, listener: socket.socket, *, request_deadline_s: float = REQUEST_DEADLINE_S,
                 max_connections_per_uid: int = MAX_CONNECTIONS_PER_UID) -> None:
        self.site = site
        self.listener = listener
        self.request_deadline_s = request_deadline_s
        self.max_connections_per_uid = max_connections_per_uid
        self.leases = LeaseTable()
        self.conns: dict[int, _Conn] = {}  # by socket fd
        self.sel = selectors.DefaultSelector()
        listener.setblocking(False)
        self.sel.register(listener, selectors.EVENT_READ, _LISTEN)

    # ------------------------------------------------------------------------------------------------ loop
    def serve(self) -> None:
        """Serve until SIGTERM/SIGINT; then every lease is dropped (the kernel would drop the locks anyway)."""
        def stop(signum: int, frame: Any) -> None:
            raise _Stop()

        old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            while True:
                now = time.monotonic()
                nearest = min((c.deadline for c in self.conns.values()), default=None)
                for key, _ in self.sel.select(None if nearest is None else max(0.0, nearest - now)):
                    if key.data == _LISTEN:
                        self._accept()
                    elif isinstance(key.data, _Conn):
                        self._readable(key.data)
                    else:
                        self._tied_exit(*key.data)
                self._expire(time.monotonic())
        except _Stop:
            log.info("broker: stopping; dropping %d lease(s)", len(self.leases))
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self.close()

    def close(self) -> None:
        for conn in list(self.conns.values()):
            self._close(conn)
        for lease in self.leases:
            self._drop(lease)
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(self.listener)
        self.listener.close()
        self.sel.close()

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # EMFILE and the like: log, keep serving those already connected
            log.warning("broker: accept failed: %s", exc)
            return
        sock.setblocking(False)
        pid, uid, _ = peer_credentials(sock)
        if sum(1 for c in self.conns.values() if c.uid == uid) >= self.max_connections_per_uid:
            self._send(sock, Refusal(
                "bad", f"uid {uid} already has {self.max_connections_per_uid} connections open to the broker",
                "close the others (one request per connection, answered in milliseconds)").reply())
            sock.close()
            return
        conn = _Conn(sock, pid, uid, self._pin(sock, pid), time.monotonic() + self.request_deadline_s)
        self.conns[sock.fileno()] = conn
        self.sel.register(sock, selectors.EVENT_READ, conn)

    @staticmethod
    def _pin(sock: socket.socket, pid: int) -> int | None:
        """A pidfd for the connection's peer. ``SO_PEERPIDFD`` is the process that connected, whatever happened
        since; without it, ``pidfd_open(pid)`` is believed only if the connection is still open afterwards
        (the caller waits for our answer: had it exited, letting the pid be reused, its end would be closed)."""
        with contextlib.suppress(OSError):
            return int(sock.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD))
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            return None
        try:
            hung_up = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            hung_up = False
        except OSError:
            hung_up = True
        if hung_up or _exited(pidfd):
            os.close(pidfd)
            return None
        return pidfd

    def _readable(self, conn: _Conn) -> None:
        try:
            chunk = conn.sock.recv(MAX_REQUEST_BYTES + 1 - len(conn.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._close(conn)
            return
        conn.buf += chunk
        if b"\n" in conn.buf:
            line = bytes(conn.buf.split(b"\n", 1)[0])
            try:
                reply = {"ok": True, **self.handle(conn, line)}
            except Refusal as r:
                reply = r.reply()
            except Exception as exc:  # noqa: BLE001 - one bad request must not end the broker for everyone
                log.exception("broker: request from uid %d pid %d failed", conn.uid, conn.pid)
                reply = Refusal("internal", f"the broker failed on this request: {exc!r}",
                                "report this with the broker's log").reply()
            self._send(conn.sock, reply)
            self._close(conn)
        elif len(conn.buf) > MAX_REQUEST_BYTES:
            self._send(conn.sock, Refusal(
                "bad", f"request longer than {MAX_REQUEST_BYTES} bytes without a newline",
                "send one JSON object on one line (launcher.gpu.broker_client does)").reply())
            self._close(conn)

    def _expire(self, now: float) -> None:
        for conn in [c for c in self.conns.values() if c.deadline <= now]:
            self._send(conn.sock, Refusal(
                "bad", f"no complete request line within {self.request_deadline_s:g} s ({len(conn.buf)} bytes sent)",
                "send the whole request at once, ending with a newline").reply())
            self._close(conn)

    @staticmethod
    def _send(sock: socket.socket, reply: dict[str, Any]) -> None:
        """One reply line. The socket buffer takes it whole; a peer that never reads cannot block the broker."""
        with contextlib.suppress(OSError):
            sock.send(encode(reply), socket.MSG_DONTWAIT)

    def _close(self, conn: _Conn) -> None:
        self.conns.pop(conn.sock.fileno(), None)
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(conn.sock)
        conn.sock.close()
        if conn.pidfd is not None:
            os.close(conn.pidfd)
            conn.pidfd = None

    # -------------------------------------------------------------------------------------------- requests
    def handle(self, conn: _Conn, line: bytes) -> dict[str, Any]:
        """One request line -> the reply's fields (``ok`` added by the caller). Raises Refusal."""
        req = parse_request(line)
        if isinstance(req, LeaseRequest):
            return self.lease(conn, req)
        if isinstance(req, TieRequest):
            return self.tie(conn, req)
        if isinstance(req, ReleaseRequest):
            return self.release(conn, req)
        assert isinstance(req, ListRequest)
        return {"leases": [x.to_dict() for x in self.leases]}

    def lease(self, conn: _Conn, req: LeaseRequest) -> dict[str, Any]:
        """Count the caller's leases, check the site cap, take the locks (all, or the first ``count`` free)."""
        if conn.pidfd is None:
            raise Refusal("bad", f"process {conn.pid} ended before its lease could be tied to it")
        try:
            policy = load_site_file(self.site.policy)
        except ConfigErrors as exc:
            raise Refusal("internal", f"cannot read the site policy: {exc.message}",
                          "ask the administrator to fix it") from None
        user = user_name(conn.uid)
        leases = self.leases.grant(conn.uid, user, req, cap=policy.max_gpus_per_user, cap_label=policy.label,
                                   lock=lambda uuid: lock_lease_file(self.site.lease_path(uuid), uuid))
        for lease in leases:
            self._watch(lease, conn.pid, os.dup(conn.pidfd))
            self._write_note(lease)
        log.info("broker: user %s (uid %d, pid %d) leased %s for run %s", user, conn.uid, conn.pid,
                 ", ".join(x.uuid for x in leases), req.run_id)
        return {"uuids": [x.uuid for x in leases]}

    def tie(self, conn: _Conn, req: TieRequest) -> dict[str, Any]:
        """Keep the caller's leases alive while process ``pid`` (the caller's uid) lives too."""
        leases = self.leases.tie_targets(conn.uid, req.uuids)
        pid, named = req.pid, ", ".join(req.uuids)
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as exc:
            raise Refusal("bad", f"no process {pid} to tie GPU(s) {named} to ({exc.strerror})") from None
        try:
            uid = proc_info(pid).uid
            if _exited(pidfd) or uid is None:  # read after pinning, checked after reading: the same process
                raise Refusal("bad", f"process {pid} exited before GPU(s) {named} could be tied to it")
            check_tie_uid(conn.uid, pid, uid)
            for lease in leases:
                if pid not in lease.pids:
                    self._watch(lease, pid, os.dup(pidfd))
                    self._write_note(lease)
        finally:
            os.close(pidfd)
        return {"uuids": list(req.uuids), "pid": pid}

    def release(self, conn: _Conn, req: ReleaseRequest) -> dict[str, Any]:
        """Drop the caller's leases of ``uuids`` now (idempotent: one already gone is reported, not refused)."""
        leases = self.leases.owned(conn.uid, req.uuids, "release")
        for lease in leases:
            self._drop(lease)
        released = [x.uuid for x in leases]
        return {"released": released, "not_held": [u for u in req.uuids if u not in released]}

    # ---------------------------------------------------------------------------------------- lease upkeep
    def _watch(self, lease: Lease, pid: int, pidfd: int) -> None:
        lease.pids[pid] = pidfd
        self.sel.register(pidfd, selectors.EVENT_READ, (lease.uuid, pid))

    def _tied_exit(self, uuid: str, pid: int) -> None:
        """A tied process exited: untie it; the lease ends with its last process."""
        lease, pidfd = self.leases.untie(uuid, pid)
        if lease is None or pidfd is None:
            return
        self.sel.unregister(pidfd)
        os.close(pidfd)
        if lease.pids:
            self._write_note(lease)
        else:
            log.info("broker: the last process of run %s (user %s) exited; %s is free", lease.run_id, lease.user, uuid)
            self._drop(lease)

    def _drop(self, lease: Lease) -> None:
        """End a lease: note first (nobody reads it as current), then the lock (closing the descriptor)."""
        self.leases.remove(lease)
        if lease.note is not None:
            with contextlib.suppress(OSError):
                lease.note.unlink()
        for pidfd in lease.pids.values():
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(pidfd)
            os.close(pidfd)
        lease.pids.clear()
        os.close(lease.fd)

    def _write_note(self, lease: Lease) -> None:
        """``holders/<UUID>@<broker pid>.json``, root's: ``launcher gpus`` reads who the lease is for from it."""
        record = lease.note_record(socket.gethostname())
        if len(json.dumps(record)) < NOTE_MAX_BYTES:
            lease.note = write_note(self.site.holders, lease.uuid, record)


def run_broker(site: Site) -> None:
    """``launcher admin broker``: check, listen, say so on stdout, serve until SIGTERM.

    Raises:
        BadInput: not root, or the site file names no broker; InsecureSite: loose lease files or directory.
    """
    if os.geteuid() != 0:
        raise BadInput(f"`launcher admin broker` must run as root (uid 0), not uid {os.geteuid()}",
                       hint="start it from systemd or with sudo: it holds every user's GPU leases")
    if site.broker is None:
        raise BadInput(f"the site file {site.site_file} names no broker socket",
                       hint="run `launcher admin init --broker /run/launcher/broker.sock` first")
    check_lease_files(site)
    listener = listen(site.broker)
    ours = os.lstat(site.broker).st_ino
    remove_stale_notes(site)
    broker = Broker(site, listener)
    print(f"launcher broker: pid {os.getpid()} serving {site.broker} for the lease store {site.store}", flush=True)
    try:
        broker.serve()
    finally:
        with contextlib.suppress(OSError):
            if os.lstat(site.broker).st_ino == ours:  # not a socket a newer broker has bound since
                os.unlink(site.broker)
