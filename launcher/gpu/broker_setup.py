"""The lease broker's start-up (:func:`launcher.gpu.broker.run_broker` calls these before serving): refuse a lease
store users could lock past the broker, bind its socket safely, and clear the notes a dead broker left.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import stat
from pathlib import Path

from launcher.errors import BadInput
from launcher.gpu.holders import NOTE_MAX_BYTES
from launcher.gpu.store import InsecureSite, Site


def check_lease_files(site: Site) -> None:
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


def remove_stale_notes(site: Site) -> None:
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
