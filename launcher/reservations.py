"""GPU reservations: two runs started at the same moment never get the same GPU.

Each GPU has a lock file ``<lock dir>/<UUID>.lock``. A run takes an exclusive ``flock`` on it and keeps the
file descriptor open for its whole life; the kernel drops the lock when the process exits, however it
exits, so a crashed launcher leaves nothing stale behind. The holder writes who it is (run id, pid,
user, host, time) into the file as JSON so ``launcher gpus`` can show it; that text is only a label, the
lock is the truth (a file whose lock is free is not held, whatever it says).

Lock directory: ``$LAUNCHER_LOCK_DIR`` if set, else ``/tmp/launcher-locks``. It must be one directory
shared by every user of the machine, which is why it is not under ``$XDG_RUNTIME_DIR`` (that is per
user). When the launcher creates it, it makes it world-writable and sticky (mode 1777, like ``/tmp``);
lock files are mode 0666 so any user can take a free GPU's lock.

Runs started in another mount namespace (another container, a host with a different ``/tmp``) do not
share the lock files; :func:`container_holders` covers those by reading the ``launcher.*`` labels of
running containers from the Docker engine.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import socket
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from launcher.errors import BadInput, NoResources

logger = logging.getLogger(__name__)

DEFAULT_LOCK_DIR = "/tmp/launcher-locks"
LOCK_DIR_ENV = "LAUNCHER_LOCK_DIR"
LOCK_SCHEMA = "launcher.lock/v1"

# Container labels the Docker backend sets on every container of a run (launcher.gpus: comma-separated UUIDs).
LABEL_RUN, LABEL_ROLE, LABEL_GROUP, LABEL_GPUS = "launcher.run", "launcher.role", "launcher.group", "launcher.gpus"

_UUID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# A probe from list_holders() holds a shared lock for microseconds; retry this long before calling a GPU busy.
_PROBE_RETRY_S = 0.05


def default_lock_dir() -> Path:
    """``$LAUNCHER_LOCK_DIR`` if set, else ``/tmp/launcher-locks``."""
    return Path(os.environ.get(LOCK_DIR_ENV) or DEFAULT_LOCK_DIR)


def _lock_dir(lock_dir: str | Path | None) -> Path:
    return Path(lock_dir) if lock_dir else default_lock_dir()


def _lock_path(directory: Path, uuid: str) -> Path:
    if not _UUID_RE.match(uuid):
        raise BadInput(f"not a GPU UUID: {uuid!r}")
    return directory / f"{uuid}.lock"


def _user() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


@dataclass(frozen=True)
class Holder:
    """Who holds a GPU's lock (read from the lock file; fields are None while the holder is still writing)."""

    uuid: str
    run_id: str | None = None
    pid: int | None = None
    user: str | None = None
    host: str | None = None
    since: float | None = None  # Unix time the lock was taken

    def describe(self) -> str:
        details = ", ".join(x for x in (self.pid and f"pid {self.pid}", self.user and f"user {self.user}") if x)
        return f"launcher run {self.run_id or '?'}" + (f" ({details})" if details else "")


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


@dataclass
class _HeldLock:
    uuid: str
    path: Path
    fd: int


@dataclass
class Reservation:
    """GPUs locked for one run. Release with :meth:`release` or by leaving the ``with`` block.

    The locks also go when the process exits, so a run does not need to release on a crash.
    """

    run_id: str
    lock_dir: Path
    _held: list[_HeldLock] = field(default_factory=list, repr=False)

    @property
    def uuids(self) -> tuple[str, ...]:
        return tuple(h.uuid for h in self._held)

    def release(self) -> None:
        """Drop every lock (idempotent). The holder text is cleared first so nobody reads it as current."""
        while self._held:
            held = self._held.pop()
            try:
                os.ftruncate(held.fd, 0)
            except OSError:
                pass  # opened read-only (someone else's file mode); nothing was written
            os.close(held.fd)  # closing the last descriptor releases the flock

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


def _ensure_dir(directory: Path) -> None:
    if directory.is_dir():
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
        os.chmod(directory, 0o1777)  # shared by every user of the machine, like /tmp
    except FileExistsError:
        if directory.is_dir():  # another launcher made it a moment ago
            return
        raise BadInput(f"the GPU lock directory {directory} exists and is not a directory",
                       hint=f"point --lock-dir or {LOCK_DIR_ENV} at a directory") from None
    except OSError as exc:  # no permission, a file where a parent should be, a read-only file system
        raise BadInput(
            f"cannot create the GPU lock directory {directory}: {exc.strerror}",
            hint=f"set {LOCK_DIR_ENV} to a directory every user of this machine can write (mode 1777)",
        ) from exc


def _open_lock_file(path: Path) -> tuple[int, bool]:
    """Open (creating) a lock file without following symlinks; (fd, writable)."""
    flags = os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags | os.O_RDWR, 0o666)
    except PermissionError:
        # Another user's file made without group/other write: the lock still works on a read-only fd.
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), False
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BadInput(f"GPU lock file {path} is a symlink; refusing to follow it",
                           hint="remove it; someone may be tampering with the lock directory") from exc
        raise
    try:
        if os.fstat(fd).st_uid == os.getuid():
            os.fchmod(fd, 0o666)  # the umask took write from other users; they must be able to lock it too
    except OSError:
        pass
    return fd, True


def _try_lock(fd: int) -> bool:
    """Take the exclusive lock without waiting. A shared-lock probe (list_holders) does not count as busy."""
    deadline = time.monotonic() + _PROBE_RETRY_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # an exclusive holder: a run
        fcntl.flock(fd, fcntl.LOCK_UN)  # only probes: let them finish
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)


def _lock_one(directory: Path, uuid: str, record: dict[str, Any]) -> _HeldLock | None:
    """Lock one GPU's file; None when another run holds it."""
    path = _lock_path(directory, uuid)
    while True:
        fd, writable = _open_lock_file(path)
        if not _try_lock(fd):
            os.close(fd)
            return None
        # Recheck after taking it: if the file was replaced or removed between our open and our lock, we
        # hold a lock nobody else will look at; start again on the file now at the path.
        try:
            same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            continue
        if writable:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({**record, "uuid": uuid}).encode(), 0)
        return _HeldLock(uuid, path, fd)


def reserve(
    uuids: Iterable[str],
    run_id: str,
    lock_dir: str | Path | None = None,
    *,
    count: int | None = None,
) -> Reservation:
    """Lock GPUs for a run, for as long as the returned :class:`Reservation` (or the process) lives.

    Never waits: a GPU held by another run is busy now. Use as a context manager, or call ``.release()``.

    Args:
        uuids: GPU UUIDs, in order of preference.
        run_id: this run's id, recorded in the lock file for ``launcher gpus``.
        lock_dir: the lock directory (None: ``$LAUNCHER_LOCK_DIR`` or ``/tmp/launcher-locks``).
        count: None: all of ``uuids`` or nothing. N: the first N that are free, in the given order.

    Raises:
        NoResources: a GPU is held by another run (``count`` None), or fewer than ``count`` are free. The
            message names the holders. Nothing stays locked.
        BadInput: a malformed UUID, or a lock directory that cannot be created.
    """
    wanted = list(dict.fromkeys(uuids))
    need = len(wanted) if count is None else count
    directory = _lock_dir(lock_dir)
    _ensure_dir(directory)
    record = {
        "schema": LOCK_SCHEMA,
        "run_id": run_id,
        "pid": os.getpid(),
        "user": _user(),
        "host": socket.gethostname(),
        "since": time.time(),
    }
    reservation = Reservation(run_id, directory)
    busy: list[str] = []
    try:
        for uuid in wanted:
            if len(reservation._held) >= need:
                break
            held = _lock_one(directory, uuid, record)
            if held is None:
                busy.append(uuid)
                if count is None:
                    break
            else:
                reservation._held.append(held)
    except BaseException:
        reservation.release()
        raise
    if len(reservation._held) < need:
        reservation.release()
        holders = {h.uuid: h for h in list_holders(directory)}
        who = "; ".join(f"{u} held by {holders[u].describe() if u in holders else 'another run'}" for u in busy)
        raise NoResources(
            f"could not reserve {need} GPU(s) for run {run_id} among {len(wanted)}: {who or 'none free'}",
            hint="wait for those runs to end (`launcher gpus` shows them), or choose other GPUs with --gpus",
        )
    logger.info("run %s reserved %s in %s", run_id, ", ".join(reservation.uuids), directory)
    return reservation


def list_holders(lock_dir: str | Path | None = None) -> list[Holder]:
    """Every GPU lock currently held in ``lock_dir``, with what its holder recorded; by UUID.

    A lock file whose lock is free (its run ended or crashed) is not listed, whatever text it holds.
    """
    directory = _lock_dir(lock_dir)
    try:
        paths = sorted(directory.glob("*.lock"))
    except OSError:
        return []
    holders: list[Holder] = []
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
                continue  # free
            except BlockingIOError:
                pass
            text = os.pread(fd, 65536, 0)
        finally:
            os.close(fd)
        holders.append(_parse_holder(path.name[: -len(".lock")], text))
    return holders


def _parse_holder(uuid: str, text: bytes) -> Holder:
    try:
        data = json.loads(text) if text else {}
    except ValueError:
        data = {}  # caught mid-write
    if not isinstance(data, dict):
        data = {}
    pid = data.get("pid")
    since = data.get("since")
    return Holder(
        uuid=uuid,
        run_id=data.get("run_id") if isinstance(data.get("run_id"), str) else None,
        pid=pid if isinstance(pid, int) else None,
        user=data.get("user") if isinstance(data.get("user"), str) else None,
        host=data.get("host") if isinstance(data.get("host"), str) else None,
        since=float(since) if isinstance(since, (int, float)) else None,
    )


def container_holders(client: Any = None) -> tuple[list[ContainerHolder], str | None]:
    """Running containers labelled ``launcher.run``, via the Docker SDK (similar to
    ``docker ps --filter label=launcher.run``).

    Args:
        client: a ``docker.DockerClient``; None connects with ``docker.from_env()``.

    Returns:
        (containers, reason): with no reachable engine, an empty list and a sentence saying why; never raises
        for a missing engine or SDK.
    """
    try:
        import docker.client
        import docker.errors
    except ImportError:
        return [], "the docker Python SDK is not installed"
    try:
        if client is None:
            client = docker.client.from_env(timeout=5)
        containers = client.containers.list(filters={"label": LABEL_RUN})
    except (docker.errors.DockerException, OSError) as exc:
        return [], f"Docker engine not reachable ({exc.__class__.__name__}): {str(exc).splitlines()[0][:200]}"
    except Exception as exc:  # requests errors that the SDK does not wrap; a missing engine must not break `gpus`
        return [], f"Docker engine not reachable ({exc.__class__.__name__})"
    found = []
    for c in containers:
        labels = c.labels or {}
        gpus = tuple(u.strip() for u in (labels.get(LABEL_GPUS) or "").split(",") if u.strip())
        found.append(
            ContainerHolder(
                container_id=c.id,
                name=c.name,
                run_id=labels.get(LABEL_RUN, ""),
                role=labels.get(LABEL_ROLE),
                group=labels.get(LABEL_GROUP),
                gpu_uuids=gpus,
            )
        )
    return sorted(found, key=lambda h: (h.run_id, h.name)), None


_CONTAINER_ID_RE = re.compile(r"([0-9a-f]{64})")


def container_id_of_pid(pid: int) -> str | None:
    """The Docker container id a host PID runs in, from ``/proc/<pid>/cgroup``; None if none or not visible."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    except OSError:
        return None
    match = _CONTAINER_ID_RE.search(text)
    return match.group(1) if match else None


def held_uuids(holders: Sequence[Holder], containers: Sequence[ContainerHolder] = ()) -> frozenset[str]:
    """The UUIDs named by lock holders and labelled containers."""
    return frozenset([h.uuid for h in holders] + [u for c in containers for u in c.gpu_uuids])
