"""Who holds a GPU lease, from the kernel: ``/proc/locks``, not from files users can write.

Each ``FLOCK ... WRITE <pid> <maj>:<min>:<inode>`` line of ``/proc/locks`` is an exclusive ``flock``; the
inode says which lease file (hence which GPU), the pid who holds it. From the pid: the uid
(``/proc/<pid>/status``, the kernel's), the container (``/proc/<pid>/cgroup``), the start time
(``/proc/<pid>/stat``). The run id is a label only: a holder note (store mode, trusted only when the note's
owner is the holder's uid) or the lock file's text (single-user mode), or a container's ``launcher.run``
label. Per-user caps count uids, which nobody can forge.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher import safefs
from launcher.engine.labels import GPUS_LABEL, GROUP_LABEL, ROLE_LABEL, RUN_LABEL

_LOCK_LINE = re.compile(r"^\d+:\s+(?P<kind>\S+)\s+\S+\s+(?P<mode>READ|WRITE)\s+(?P<pid>-?\d+)\s+"
                        r"(?P<maj>[0-9a-f]+):(?P<min>[0-9a-f]+):(?P<ino>\d+)\s")
_CONTAINER_ID_RE = re.compile(r"([0-9a-f]{64})")


@dataclass(frozen=True)
class KernelLock:
    """One granted lock from ``/proc/locks`` (waiters, the ``->`` lines, are left out)."""

    kind: str  # FLOCK, POSIX, OFDLCK
    exclusive: bool
    pid: int  # 0 or -1: a process not visible from this PID namespace (or an OFD lock)
    dev: tuple[int, int]  # (major, minor)
    inode: int


def parse_proc_locks(text: str) -> list[KernelLock]:
    """Parse ``/proc/locks`` (pure). Lines the pattern does not fit (waiters, future formats) are skipped."""
    out = []
    for line in text.splitlines():
        if "->" in line:
            continue
        m = _LOCK_LINE.match(line)
        if m is None:
            continue
        out.append(KernelLock(kind=m["kind"], exclusive=m["mode"] == "WRITE", pid=int(m["pid"]),
                              dev=(int(m["maj"], 16), int(m["min"], 16)), inode=int(m["ino"])))
    return out


def read_proc_locks() -> list[KernelLock]:
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as fh:
            return parse_proc_locks(fh.read())
    except OSError:
        return []


@dataclass(frozen=True)
class ProcInfo:
    """What ``/proc/<pid>`` says about a lease holder (None where it is not visible from here)."""

    uid: int | None
    user: str | None
    container_id: str | None
    started_at: float | None  # Unix time the process started
    command: str | None


def _boot_time() -> float | None:
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except OSError:
        pass
    return None


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def proc_info(pid: int) -> ProcInfo:
    """uid (real), user, container id, start time and command line of ``pid``; fields None when unreadable."""
    if pid <= 0:
        return ProcInfo(None, None, None, None, None)
    uid = container = started = command = None
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("Uid:"):
                    uid = int(line.split()[1])
                    break
    except (OSError, ValueError):
        return ProcInfo(None, None, None, None, None)
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8", errors="replace") as fh:
            m = _CONTAINER_ID_RE.search(fh.read())
            container = m.group(1) if m else None
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        boot = _boot_time()
        if boot is not None:
            started = boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        pass
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fb:
            argv = [a.decode(errors="replace") for a in fb.read().split(b"\0") if a]
        command = " ".join(argv) or None
    except OSError:
        pass
    return ProcInfo(uid, None if uid is None else user_name(uid), container, started, command)


def file_key(st: os.stat_result) -> tuple[tuple[int, int], int]:
    """The (device, inode) a ``/proc/locks`` line names for the file ``st`` describes."""
    return (os.major(st.st_dev), os.minor(st.st_dev)), st.st_ino


def exclusive_holders(files: Mapping[tuple[tuple[int, int], int], str],
                      locks: Iterable[KernelLock]) -> dict[str, list[int]]:
    """Key (what ``files`` maps each lock file's (device, inode) to, e.g. a GPU UUID) -> pids holding an
    exclusive ``flock`` on it (pure; normally one pid, more only while a lease is handed to a child)."""
    held: dict[str, list[int]] = {}
    for lk in locks:
        if lk.kind != "FLOCK" or not lk.exclusive:
            continue
        key = files.get((lk.dev, lk.inode))
        if key is not None:
            held.setdefault(key, []).append(lk.pid)
    return held


@dataclass(frozen=True)
class ContainerHolder:
    """A running container of a launcher run, from its ``launcher.*`` labels."""

    container_id: str
    name: str
    run_id: str
    role: str | None = None
    group: str | None = None
    gpu_uuids: tuple[str, ...] = ()

    def describe(self) -> str:
        role = f", {self.role}" + (f" {self.group}" if self.group is not None else "") if self.role else ""
        return f"launcher run {self.run_id} (container {self.name}{role})"


def container_holders() -> tuple[list[ContainerHolder], str | None]:
    """Running containers labelled ``launcher.run``, through the engine layer (similar to
    ``docker ps --filter label=launcher.run``).

    Returns:
        (containers, reason): with no reachable engine (or no Docker SDK), an empty list and a sentence
        saying why; never raises, so a missing engine does not break ``launcher gpus`` or planning.
    """
    try:
        from launcher.engine.client import labelled_containers
    except ImportError as exc:  # the engine layer imports the SDK lazily; be safe if that changes
        return [], f"Docker engine not reachable (the docker SDK cannot be imported: {exc})"
    try:
        containers, reason = labelled_containers({RUN_LABEL: None})
    except Exception as exc:  # noqa: BLE001 - a missing or broken engine must not break `gpus`
        return [], f"Docker engine not reachable ({exc.__class__.__name__})"
    if reason is not None:
        return [], f"Docker engine not reachable: {reason}"
    found = []
    for c in containers:
        labels = c.labels or {}
        gpus = tuple(u.strip() for u in (labels.get(GPUS_LABEL) or "").split(",") if u.strip())
        found.append(
            ContainerHolder(
                container_id=c.id,
                name=c.name,
                run_id=labels.get(RUN_LABEL, ""),
                role=labels.get(ROLE_LABEL),
                group=labels.get(GROUP_LABEL),
                gpu_uuids=gpus,
            )
        )
    return sorted(found, key=lambda h: (h.run_id, h.name)), None


def container_id_of_pid(pid: int) -> str | None:
    """The Docker container id a host PID runs in, from ``/proc/<pid>/cgroup``; None if none or not visible."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    except OSError:
        return None
    match = _CONTAINER_ID_RE.search(text)
    return match.group(1) if match else None


def write_note(holders_dir: Path, uuid: str, record: dict[str, Any]) -> Path | None:
    """Store mode: the lease holder's note (run id, host, since) ``<UUID>@<pid>.json``, owned by this user.
    A label only; None when it cannot be written (another user's stale note with our pid, no directory)."""
    path = holders_dir / f"{uuid}@{os.getpid()}.json"
    try:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a note of an earlier process of ours with the same pid
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError:
        return None
    with os.fdopen(fd, "w") as fh:
        fh.write(json.dumps({**record, "uuid": uuid}))
    return path


NOTE_MAX_BYTES = 64 * 1024  # a holder note or a single-user lock file's text: a few hundred bytes in practice


def read_label(note: Path | None, lock_path: Path, pid: int, uid: int | None) -> dict[str, Any]:
    """The holder's own words (run id, host, since): its ``note`` (store mode), believed only when owned by
    the holder's uid, else the lock file's text (single-user mode), believed only when it names its pid.

    Any user can plant a file under a holder's note name (``holders/`` is 1733) or in the single-user lock
    directory, so each is read through :mod:`launcher.safefs`: opened ``O_NONBLOCK|O_NOFOLLOW``, ``fstat``\\ ed
    to be a regular file of the expected owner and at most :data:`NOTE_MAX_BYTES`, and only then read. A FIFO
    or a huge sparse file there is a missing label, never a launcher that hangs or runs out of memory."""
    path = note or lock_path
    try:
        raw = safefs.read_bytes(path.parent, path.name, max_bytes=NOTE_MAX_BYTES,
                                owner_uid=(-1 if uid is None else uid) if note is not None else None)
        data = json.loads(raw) if raw else {}
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or (note is None and data.get("pid") != pid):
        return {}
    return data
