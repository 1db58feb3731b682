"""Local processes a run's record names: are they still the run's, and stopping them in order.

A pid in ``run.json`` may have been given to another process since, and ``run.json`` lives in a directory the
run's containers (and, under a shared results root, other users) can write. Before signalling a pid, ``down``
asks :func:`belongs`: the command line names the run, the process started when the record says (its start
time in clock ticks since boot, ``/proc/<pid>/stat`` field 22, which a recycled pid does not share), it runs as
the run directory's owner, and it leads its own process group (``down`` signals the group). A root
``down --all`` therefore cannot be steered into killing another user's process group by a forged record.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ProcInfo:
    """What ``/proc`` says about one live process."""

    pid: int
    uid: int  # effective uid (the owner of /proc/<pid>)
    pgid: int
    start_ticks: int  # clock ticks after boot; with the pid, names one process for the life of the host
    state: str  # R, S, D, Z, ...


def proc_info(pid: int) -> ProcInfo | None:
    """``/proc/<pid>``'s owner, process group, start time and state; None when it is gone or unreadable."""
    if pid <= 0:
        return None
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
        with open(f"/proc/{pid}/stat", "rb") as fh:
            rest = fh.read(4096).rsplit(b")", 1)[1].split()
        return ProcInfo(pid, uid, int(rest[2]), int(rest[19]), rest[0].decode())
    except (OSError, IndexError, ValueError):
        return None


def identity(pid: int) -> dict[str, int]:
    """``{"start": ticks, "uid": uid}`` of ``pid`` for a run record (empty when it is gone)."""
    info = proc_info(pid)
    return {} if info is None else {"start": info.start_ticks, "uid": info.uid}


def launcher_record() -> dict[str, Any]:
    """This launcher's pid and identity for ``run.json`` (``down`` signals it only while both still match)."""
    return {"launcher_pid": os.getpid(), "launcher_start": identity(os.getpid()).get("start")}


def holds_flock(pid: int, path: str | os.PathLike[str]) -> bool:
    """Whether process ``pid`` holds a ``flock`` on the file at ``path`` (``/proc/locks``). A run's launcher
    holds its liveness lease (a lock on the run directory); nobody can make another user's process hold a lock
    on their directory, so this proves a recorded launcher pid is really the run's launcher."""
    try:
        st = os.stat(path, follow_symlinks=False)
        with open("/proc/locks") as fh:
            lines = fh.read(1 << 20).splitlines()
    except OSError:
        return False
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        f = line.split()
        if "->" in f:  # a waiter, not a holder
            continue
        if len(f) >= 6 and f[1] == "FLOCK" and f[4] == str(pid) and f[5] == want:
            return True
    return False


def belongs(pid: int, marker: str, *, start: int | None, owner_uid: int | None, leader: bool) -> bool:
    """Whether ``pid`` is a live process of a run, safe to signal.

    Args:
        marker: a string its command line must contain (the run id, or ``launcher``).
        start: the start time the run record gave for it. None (a record without one: from before start times
            were kept, or rewritten by someone) is never enough: only the command line would be left to go by,
            and any process of the user that mentions the run (``tensorboard --logdir results/RUN``) has that.
        owner_uid: the uid it must run as (the run directory's owner); None: any.
        leader: it must lead its own process group (it is signalled with ``killpg``).
    """
    if start is None:
        return False
    info = proc_info(pid)
    if info is None or info.state == "Z" or not running(pid, marker):
        return False
    if info.start_ticks != start:
        return False  # the pid was recycled, or the record is forged
    if owner_uid is not None and info.uid != owner_uid:
        return False
    if leader and info.pgid != pid:
        return False
    return os.geteuid() == 0 or info.uid == os.geteuid()


def cmdline(pid: int) -> str | None:
    """The process's command line, arguments joined by spaces; None when it is gone or not visible."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None


def running(pid: int, must_contain: str | None = None, *, ours: bool = False) -> bool:
    """Whether ``pid`` is alive and not a zombie, its command line contains ``must_contain``, and (``ours``) it
    belongs to this user (any user for root)."""
    if pid <= 0:
        return False
    cmd = cmdline(pid)
    if not cmd or (must_contain is not None and must_contain not in cmd):
        return False
    try:
        owner = os.stat(f"/proc/{pid}").st_uid
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    if state == "Z":
        return False
    return not ours or os.geteuid() == 0 or owner == os.geteuid()


def pid_is_ours(pid: int, must_contain: str) -> bool:
    """Whether ``pid`` is alive, this user's (any user's for root), not a zombie, and its command line
    contains ``must_contain`` (a guard against a recycled pid)."""
    return running(pid, must_contain, ours=True)


def wait_gone(pids: list[tuple[int, str]], timeout_s: float) -> list[tuple[int, str]]:
    """Wait up to ``timeout_s`` seconds for (pid, marker) processes to end; returns those still there."""
    deadline = time.monotonic() + timeout_s
    alive = [p for p in pids if pid_is_ours(*p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if pid_is_ours(*p)]
    return alive


def send_signal(pid: int, sig: int, *, group: bool) -> None:
    """``kill`` (``group``: ``killpg``) that ignores a process already gone or not ours."""
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
