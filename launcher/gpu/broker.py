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
  :data:`~launcher.gpu.broker_client.MAX_REQUEST_BYTES`; a connection that has not sent one within
  :data:`REQUEST_DEADLINE_S` is answered with a refusal and closed; one uid may hold at most
  :data:`MAX_CONNECTIONS_PER_UID` connections open.

Requests (``op``): ``lease {run_id, uuids, count|null}``, ``tie {uuids, pid}``, ``release {uuids}``, ``list``.
Replies: ``{"ok": true, ...}`` or ``{"ok": false, "refusal": "busy"|"cap"|"denied"|"bad"|"internal",
"error": ..., "hint": ...}``. The client side is :mod:`launcher.gpu.broker_client`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import select
import selectors
import signal
import socket
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.errors import BadInput, ConfigErrors
from launcher.gpu.broker_client import MAX_REQUEST_BYTES, SCHEMA, peer_credentials
from launcher.gpu.holders import NOTE_MAX_BYTES, user_name, write_note
from launcher.gpu.policy import load_site_file
from launcher.gpu.store import InsecureSite, Site, valid_uuid

log = logging.getLogger(__name__)

REQUEST_DEADLINE_S = 2.0  # a connection must send its whole request line within this
MAX_CONNECTIONS_PER_UID = 16  # open connections one uid may hold at once; more are refused at once
MAX_UUIDS = 64  # in one request
NOTE_SCHEMA = "launcher.lock/v1"
_SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux 6.5+; Python 3.11 has no name for it
_LISTEN = "listen"


class Refusal(Exception):
    """A request the broker answers with ``ok: false`` (its ``kind`` is the reply's ``refusal``)."""

    def __init__(self, kind: str, error: str, hint: str | None = None) -> None:
        super().__init__(error)
        self.kind, self.error, self.hint = kind, error, hint


class _Stop(Exception):
    """SIGTERM or SIGINT: leave the loop."""


@dataclass
class Lease:
    """One GPU leased through the broker."""

    uuid: str
    fd: int  # the broker's descriptor holding the exclusive flock
    uid: int
    user: str
    run_id: str
    since: float
    pids: dict[int, int] = field(default_factory=dict)  # tied pid -> its pidfd
    note: Path | None = None

    def describe(self) -> str:
        return f"launcher run {self.run_id} (user {self.user}, pid {', '.join(map(str, self.pids)) or '?'})"

    def to_dict(self) -> dict[str, Any]:
        return {"uuid": self.uuid, "uid": self.uid, "user": self.user, "run_id": self.run_id,
                "pids": list(self.pids), "since": self.since}


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


def _real_uid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


class Broker:
    """The broker's state and its loop. ``serve`` runs it; tests may build one and call ``serve`` in a process."""

    def __init__(self, site: Site, listener: socket.socket, *, request_deadline_s: float = REQUEST_DEADLINE_S,
                 max_connections_per_uid: int = MAX_CONNECTIONS_PER_UID) -> None:
        self.site = site
        self.listener = listener
        self.request_deadline_s = request_deadline_s
        self.max_connections_per_uid = max_connections_per_uid
        self.leases: dict[str, Lease] = {}
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
        for lease in list(self.leases.values()):
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
            self._send(sock, self._refusal(Refusal(
                "bad", f"uid {uid} already has {self.max_connections_per_uid} connections open to the broker",
                "close the others (one request per connection, answered in milliseconds)")))
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
                reply = self._refusal(r)
            except Exception as exc:  # noqa: BLE001 - one bad request must not end the broker for everyone
                log.exception("broker: request from uid %d pid %d failed", conn.uid, conn.pid)
                reply = self._refusal(Refusal("internal", f"the broker failed on this request: {exc!r}",
                                              "report this with the broker's log"))
            self._send(conn.sock, reply)
            self._close(conn)
        elif len(conn.buf) > MAX_REQUEST_BYTES:
            self._send(conn.sock, self._refusal(Refusal(
                "bad", f"request longer than {MAX_REQUEST_BYTES} bytes without a newline",
                "send one JSON object on one line (launcher.gpu.broker_client does)")))
            self._close(conn)

    def _expire(self, now: float) -> None:
        for conn in [c for c in self.conns.values() if c.deadline <= now]:
            self._send(conn.sock, self._refusal(Refusal(
                "bad", f"no complete request line within {self.request_deadline_s:g} s ({len(conn.buf)} bytes sent)",
                "send the whole request at once, ending with a newline")))
            self._close(conn)

    @staticmethod
    def _send(sock: socket.socket, reply: dict[str, Any]) -> None:
        """One reply line. The socket buffer takes it whole; a peer that never reads cannot block the broker."""
        with contextlib.suppress(OSError):
            sock.send(json.dumps(reply, separators=(",", ":")).encode() + b"\n", socket.MSG_DONTWAIT)

    @staticmethod
    def _refusal(r: Refusal) -> dict[str, Any]:
        return {"ok": False, "refusal": r.kind, "error": r.error, **({"hint": r.hint} if r.hint else {})}

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
        try:
            req = json.loads(line)
        except ValueError:
            raise Refusal("bad", f"not JSON: {line[:80]!r}", "send one JSON object per line") from None
        if not isinstance(req, dict):
            raise Refusal("bad", f"expected a JSON object, got {type(req).__name__}")
        if req.get("schema", SCHEMA) != SCHEMA:
            raise Refusal("bad", f"schema {req.get('schema')!r} is not {SCHEMA!r}",
                          "use a launcher of the broker's version")
        op = req.get("op")
        if op == "lease":
            return self.lease(conn, req)
        if op == "tie":
            return self.tie(conn, req)
        if op == "release":
            return self.release(conn, req)
        if op == "list":
            return {"leases": [x.to_dict() for x in self.leases.values()]}
        raise Refusal("bad", f"unknown op {op!r}; expected lease, tie, release or list")

    @staticmethod
    def _uuids(req: dict[str, Any]) -> list[str]:
        uuids = req.get("uuids")
        if not isinstance(uuids, list) or not uuids or len(uuids) > MAX_UUIDS:
            raise Refusal("bad", f"uuids must be a list of 1 to {MAX_UUIDS} GPU UUIDs, got {str(uuids)[:80]}")
        bad = [u for u in uuids if not isinstance(u, str) or not valid_uuid(u)]
        if bad:
            raise Refusal("bad", f"not a GPU UUID: {str(bad[0])[:80]!r}")
        return list(dict.fromkeys(uuids))

    def _own(self, conn: _Conn, uuids: list[str], what: str) -> list[Lease]:
        """The leases of ``uuids`` that exist; Refusal if one is another user's (root may touch any)."""
        found = [self.leases[u] for u in uuids if u in self.leases]
        for lease in found:
            if conn.uid not in (0, lease.uid):
                raise Refusal("denied", f"GPU {lease.uuid} is leased by user {lease.user} (uid {lease.uid}) for run "
                              f"{lease.run_id}, not by you (uid {conn.uid}): only its user may {what} it",
                              "name only your own run's GPUs (`launcher gpus` shows who holds what)")
        return found

    def lease(self, conn: _Conn, req: dict[str, Any]) -> dict[str, Any]:
        """Count the caller's leases, check the site cap, take the locks (all, or the first ``count`` free)."""
        uuids = self._uuids(req)
        run_id, count = req.get("run_id"), req.get("count")
        if not isinstance(run_id, str) or not 0 < len(run_id) <= 200 or not run_id.isprintable():
            raise Refusal("bad", f"run_id must be printable text of 1 to 200 characters, got {str(run_id)[:80]!r}")
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or not 0 < count <= len(uuids)):
            raise Refusal("bad", f"count must be null or a whole number from 1 to {len(uuids)}, got {count!r}")
        if conn.pidfd is None:
            raise Refusal("bad", f"process {conn.pid} ended before its lease could be tied to it")
        try:
            policy = load_site_file(self.site.policy)
        except ConfigErrors as exc:
            raise Refusal("internal", f"cannot read the site policy: {exc.message}",
                          "ask the administrator to fix it") from None
        want = len(uuids) if count is None else count
        user = user_name(conn.uid)
        mine = [x.uuid for x in self.leases.values() if x.uid == conn.uid]
        cap = policy.max_gpus_per_user
        if cap is not None and len(mine) + want > cap:
            held = f"holds {len(mine)} GPU lease(s)" + (f" ({', '.join(mine)})" if mine else "")
            raise Refusal("cap", f"user {user} (uid {conn.uid}) {held} and asks for {want} more for run {run_id}; "
                          f"{policy.label} allows {cap} at once",
                          "wait for your other runs to end (`launcher gpus` shows them), or ask for fewer GPUs")
        taken: list[tuple[str, int]] = []
        busy: list[str] = []
        try:
            for uuid in uuids:
                if len(taken) >= want:
                    break
                fd = self._lock(uuid)
                if fd is None:
                    busy.append(uuid)
                    if count is None:
                        break
                else:
                    taken.append((uuid, fd))
        except BaseException:
            for _, fd in taken:
                os.close(fd)
            raise
        if len(taken) < want:
            for _, fd in taken:
                os.close(fd)
            who = "; ".join(f"{u} held by {self.leases[u].describe() if u in self.leases else 'a process outside the broker'}"
                            for u in busy)
            raise Refusal("busy", f"could not reserve {want} GPU(s) for run {run_id} among {len(uuids)}: "
                          f"{who or 'none free'}",
                          "wait for those runs to end (`launcher gpus` shows them; `launcher up --wait` queues), or "
                          "choose other GPUs with --gpus")
        now = time.time()
        for uuid, fd in taken:
            lease = Lease(uuid, fd, conn.uid, user, run_id, now)
            self.leases[uuid] = lease
            self._watch(lease, conn.pid, os.dup(conn.pidfd))
            self._write_note(lease)
        log.info("broker: user %s (uid %d, pid %d) leased %s for run %s", user, conn.uid, conn.pid,
                 ", ".join(u for u, _ in taken), run_id)
        return {"uuids": [u for u, _ in taken]}

    def _lock(self, uuid: str) -> int | None:
        """The broker's exclusive flock on ``uuid``'s lease file; None when something holds it already."""
        if uuid in self.leases:
            return None
        path = self.site.lease_path(uuid)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise Refusal("bad", f"GPU {uuid} has no lease file in the store ({path})",
                          "ask the administrator to run `launcher admin init --broker ...` again (it makes one per "
                          "GPU and MIG instance it finds)") from None
        except OSError as exc:
            raise Refusal("internal", f"cannot open the lease file {path}: {exc.strerror}") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0:
            os.close(fd)
            raise Refusal("internal", f"the lease file {path} is not a regular file of root's (uid {st.st_uid})",
                          "ask the administrator to run `launcher admin init --broker ...` again")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    def tie(self, conn: _Conn, req: dict[str, Any]) -> dict[str, Any]:
        """Keep the caller's leases alive while process ``pid`` (the caller's uid) lives too."""
        uuids = self._uuids(req)
        pid = req.get("pid")
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise Refusal("bad", f"pid must be a positive whole number, got {pid!r}")
        leases = self._own(conn, uuids, "tie a process to")
        gone = [u for u in uuids if u not in self.leases]
        if gone:
            raise Refusal("bad", f"GPU(s) {', '.join(gone)} are not leased through this broker (the lease may have "
                          "ended with its processes)", "lease them again")
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as exc:
            raise Refusal("bad", f"no process {pid} to tie GPU(s) {', '.join(uuids)} to ({exc.strerror})") from None
        try:
            uid = _real_uid(pid)
            if _exited(pidfd) or uid is None:  # read after pinning, checked after reading: the same process
                raise Refusal("bad", f"process {pid} exited before GPU(s) {', '.join(uuids)} could be tied to it")
            if conn.uid != 0 and uid != conn.uid:
                raise Refusal("denied", f"process {pid} runs as uid {uid}, not as you (uid {conn.uid}): a lease can "
                              "only be tied to your own processes",
                              "tie the lease to your run's master (`launcher up` does this itself)")
            for lease in leases:
                if pid not in lease.pids:
                    self._watch(lease, pid, os.dup(pidfd))
                    self._write_note(lease)
        finally:
            os.close(pidfd)
        return {"uuids": uuids, "pid": pid}

    def release(self, conn: _Conn, req: dict[str, Any]) -> dict[str, Any]:
        """Drop the caller's leases of ``uuids`` now (idempotent: one already gone is reported, not refused)."""
        uuids = self._uuids(req)
        leases = self._own(conn, uuids, "release")
        for lease in leases:
            self._drop(lease)
        return {"released": [x.uuid for x in leases], "not_held": [u for u in uuids if u not in {x.uuid for x in leases}]}

    # ---------------------------------------------------------------------------------------- lease upkeep
    def _watch(self, lease: Lease, pid: int, pidfd: int) -> None:
        lease.pids[pid] = pidfd
        self.sel.register(pidfd, selectors.EVENT_READ, (lease.uuid, pid))

    def _tied_exit(self, uuid: str, pid: int) -> None:
        """A tied process exited: untie it; the lease ends with its last process."""
        lease = self.leases.get(uuid)
        if lease is None or pid not in lease.pids:
            return
        pidfd = lease.pids.pop(pid)
        self.sel.unregister(pidfd)
        os.close(pidfd)
        if lease.pids:
            self._write_note(lease)
        else:
            log.info("broker: the last process of run %s (user %s) exited; %s is free", lease.run_id, lease.user, uuid)
            self._drop(lease)

    def _drop(self, lease: Lease) -> None:
        """End a lease: note first (nobody reads it as current), then the lock (closing the descriptor)."""
        self.leases.pop(lease.uuid, None)
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
        pids = list(lease.pids)
        record = {"schema": NOTE_SCHEMA, "run_id": lease.run_id, "uid": lease.uid, "user": lease.user, "pids": pids,
                  "pid": pids[-1] if pids else None, "since": lease.since, "host": socket.gethostname(), "broker": True}
        if len(json.dumps(record)) < NOTE_MAX_BYTES:
            lease.note = write_note(self.site.holders, lease.uuid, record)


# ------------------------------------------------------------------------------------------------ start-up
def _check_lease_files(site: Site) -> None:
    """Refuse to start over lease files users can open: they could flock them past the broker."""
    try:
        paths = sorted(site.leases.glob("*.lock"))
    except OSError as exc:
        raise InsecureSite(f"cannot list the lease store {site.leases}: {exc.strerror}") from None
    loose = [p for p in paths if stat.S_IMODE(os.lstat(p).st_mode) & 0o077 or os.lstat(p).st_uid != 0]
    if loose:
        mode = stat.S_IMODE(os.lstat(loose[0]).st_mode)
        raise InsecureSite(f"{len(loose)} lease file(s) in {site.leases} can be opened by users (e.g. {loose[0].name}, "
                           f"mode {mode:04o}): they could flock them past the broker",
                           hint=f"run `launcher admin init --broker {site.broker}` (it makes them root 0600)")


def listen(path: Path) -> socket.socket:
    """Bind the broker's socket: its directory root 0755, the socket 0666 (every user may ask). A socket left by
    a dead broker is replaced; one a live broker answers on is not.

    Raises:
        BadInput: another broker answers there, or a non-socket is in the way; InsecureSite: a loose directory.
    """
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    st = os.lstat(path.parent)
    if st.st_uid != 0 or st.st_mode & 0o022 or not stat.S_ISDIR(st.st_mode):
        raise InsecureSite(f"the broker socket's directory {path.parent} is owned by uid {st.st_uid} with mode "
                           f"{stat.S_IMODE(st.st_mode):04o}; it must be root's and writable by root only",
                           hint=f"chown root:root {path.parent} && chmod 0755 {path.parent}")
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise BadInput(f"{path} exists and is not a socket", hint="move it away, or name another socket in the "
                           "site file")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError as exc:
            if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                raise
            os.unlink(path)  # a dead broker's
        else:
            raise BadInput(f"another lease broker already serves {path}",
                           hint="stop it first (`systemctl stop launcher-broker`), or leave it running")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.bind(str(path))
    os.chmod(path, 0o666)
    sock.listen(128)
    return sock


def _remove_stale_notes(site: Site) -> None:
    """Notes a previous broker left (it died without cleaning up): root's and marked ``broker``. Its leases
    ended with it."""
    me = f"@{os.getpid()}.json"
    with contextlib.suppress(OSError):
        for note in site.holders.glob("*@*.json"):
            with contextlib.suppress(OSError, ValueError):
                st = os.lstat(note)
                if (note.name.endswith(me) or not stat.S_ISREG(st.st_mode) or st.st_uid != 0
                        or st.st_size > NOTE_MAX_BYTES):
                    continue
                if json.loads(note.read_bytes()).get("broker") is True:
                    note.unlink()


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
    _check_lease_files(site)
    listener = listen(site.broker)
    ours = os.lstat(site.broker).st_ino
    _remove_stale_notes(site)
    broker = Broker(site, listener)
    print(f"launcher broker: pid {os.getpid()} serving {site.broker} for the lease store {site.store}", flush=True)
    try:
        broker.serve()
    finally:
        with contextlib.suppress(OSError):
            if os.lstat(site.broker).st_ino == ours:  # not a socket a newer broker has bound since
                os.unlink(site.broker)
