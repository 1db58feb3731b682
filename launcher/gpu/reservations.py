"""GPU leases: two runs never hold the same GPU, across users, and a crash leaves nothing held.

Each GPU (or MIG instance) has a lease file ``<UUID>.lock``; a run takes an exclusive ``flock`` on it and
keeps the descriptor for its whole life, and the kernel drops it when the holder dies, however it dies.
Who holds a lease is read from the kernel (``/proc/locks``), never from text: :mod:`launcher.gpu.leaseholders`.

Two modes (:func:`lease_dir`): with an admin store (:mod:`launcher.gpu.store`) the lease files are root's
and opened read-only, and ``--lock-dir`` cannot bypass them; without one, a single-user lock directory
(``$LAUNCHER_LOCK_DIR`` or ``/tmp/launcher-locks``, 1777, 0666 files) as before, which only holds between
one user's runs. Runs in another mount namespace are seen through their containers' labels
(:func:`launcher.gpu.holders.container_holders`).

With a lease broker (the site file names its socket, :mod:`launcher.gpu.broker`) the launcher locks nothing
itself: the broker, root, takes the leases (the per-user cap and the locks in one step), holds the locks and
keeps them while any process tied to them lives; the lease files are then root 0600 and users cannot lock them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from launcher.errors import BadInput, LauncherError, MissingDependency, NoResources
from launcher.gpu import broker_client
from launcher.gpu.holders import user_name, write_note
from launcher.gpu.store import InsecureSite, Site, find_site, valid_uuid

logger = logging.getLogger(__name__)

DEFAULT_LOCK_DIR = "/tmp/launcher-locks"
LOCK_DIR_ENV = "LAUNCHER_LOCK_DIR"
LOCK_SCHEMA = "launcher.lock/v1"

# A probe from an older launcher holds a shared lock for microseconds; retry this long before calling a GPU busy.
_PROBE_RETRY_S = 0.05
_UNSET: Any = object()


def default_lock_dir() -> Path:
    """``$LAUNCHER_LOCK_DIR`` if set, else ``/tmp/launcher-locks`` (single-user mode only)."""
    return Path(os.environ.get(LOCK_DIR_ENV) or DEFAULT_LOCK_DIR)


@dataclass(frozen=True)
class LeaseDir:
    """Where leases are taken: the admin store's ``leases/`` (``site`` set) or a single-user lock directory."""

    path: Path
    site: Site | None = None

    @property
    def queue(self) -> Path:
        return self.site.queue if self.site else self.path / "queue"


def lease_dir(lock_dir: str | Path | None = None, *, site: Site | None = _UNSET) -> LeaseDir:
    """Resolve the lease directory. With an admin store, ``--lock-dir``/``$LAUNCHER_LOCK_DIR`` naming another
    directory is refused: leases that bypass the store would not keep other users' runs off those GPUs.

    Raises:
        BadInput: a lock directory beside the admin store; InsecureSite: a store others can write.
    """
    site = find_site() if site is _UNSET else site
    if site is None:
        return LeaseDir(Path(lock_dir) if lock_dir else default_lock_dir())
    for given, what in ((lock_dir, "--lock-dir"), (os.environ.get(LOCK_DIR_ENV), f"${LOCK_DIR_ENV}")):
        if given and os.path.realpath(given) != os.path.realpath(site.leases):
            raise BadInput(f"{what} {given}: this machine has an admin lease store ({site.leases}, set up in "
                           f"{site.site_file}); every run leases its GPUs there, so another lock directory "
                           "is not allowed", hint=f"leave out --lock-dir and unset {LOCK_DIR_ENV}")
    return LeaseDir(site.leases, site)


def _lock_path(directory: Path, uuid: str) -> Path:
    if not valid_uuid(uuid):
        raise BadInput(f"not a GPU UUID: {uuid!r}")
    return directory / f"{uuid}.lock"


@dataclass
class _HeldLock:
    uuid: str
    path: Path
    fd: int
    note: Path | None = None


@dataclass
class Reservation:
    """GPUs leased for one run. Release with :meth:`release` or by leaving the ``with`` block.

    The locks also go when the process exits (the kernel drops them), so a crash leaves nothing held.
    """

    run_id: str
    lock_dir: Path
    _held: list[_HeldLock] = field(default_factory=list, repr=False)
    broker: Path | None = None  # the lease broker's socket when the broker holds these leases
    _brokered: list[str] = field(default_factory=list, repr=False)  # UUIDs the broker leased for this run
    _with_master: bool = field(default=False, repr=False)  # handed to the master's tie: release() leaves them

    @property
    def uuids(self) -> tuple[str, ...]:
        return tuple(h.uuid for h in self._held) + tuple(self._brokered)

    @property
    def brokered(self) -> bool:
        """Whether the lease broker holds these leases (then there are no descriptors to pass: :meth:`tie`)."""
        return self.broker is not None

    @property
    def fds(self) -> tuple[int, ...]:
        """The locked descriptors: a process backend passes them to the master child (``pass_fds``), which
        then keeps the leases for as long as it lives, even if the launcher is killed. None with a broker."""
        return tuple(h.fd for h in self._held)

    @property
    def paths(self) -> tuple[Path, ...]:
        """The lease files, e.g. to bind-mount into a master container that takes the leases over."""
        return tuple(h.path for h in self._held) + tuple(self.lock_dir / f"{u}.lock" for u in self._brokered)

    def tie(self, pid: int) -> None:
        """With a broker: keep these leases for as long as process ``pid`` (this user's; the run's master)
        lives too, even after this launcher exits. Without one there is nothing to do: the process backend's
        master inherits the locked descriptors (:attr:`fds`) and a Docker master takes the files over.

        Raises:
            LauncherError: the broker refused (another user's process) or is not answering.
        """
        if self.broker is not None and self._brokered:
            broker_client.tie(self.broker, self._brokered, pid)

    def hand_to_master(self) -> None:
        """With a broker, once :meth:`tie` has tied the leases to a master that outlives this launcher (a Docker
        master container): from now on the leases end with their tied processes (the master's, and this
        launcher's until it exits), and :meth:`release` leaves them alone, as a detached run needs."""
        self._with_master = True

    def release(self) -> None:
        """Drop every lease (idempotent). The holder text is cleared first so nobody reads it as current."""
        if self.broker is not None and self._brokered and not self._with_master:
            uuids, self._brokered = self._brokered, []
            try:
                broker_client.release(self.broker, uuids)
            except LauncherError as exc:  # a release runs in teardown: say it, do not mask what ended the run
                logger.warning("could not release GPU lease(s) %s through the broker: %s; they end when this run's "
                               "processes have exited", ", ".join(uuids), exc.message)
        while self._held:
            _drop(self._held.pop(), unlock=False)

    def release_some(self, uuids: Iterable[str]) -> tuple[str, ...]:
        """Drop the leases of ``uuids`` only (an elastic run's yielded groups' GPUs); returns those dropped.

        The lock is taken off the open file description itself (``LOCK_UN``), so a copy of the descriptor the
        process backend's master inherited does not keep it: the GPU is free the moment this returns."""
        drop = set(uuids)
        if self.broker is not None:
            mine = [u for u in self._brokered if u in drop]
            if mine:
                broker_client.release(self.broker, mine)
                self._brokered = [u for u in self._brokered if u not in drop]
            return tuple(mine)
        gone = [h for h in self._held if h.uuid in drop]
        for held in gone:
            self._held.remove(held)
            _drop(held, unlock=True)
        return tuple(h.uuid for h in gone)

    def take_back(self, uuids: Iterable[str]) -> bool:
        """Lease ``uuids`` again for this run, all or none, without waiting (an elastic run growing back).
        False when another run holds one of them now. With a broker the backend ties them to its master again
        (:meth:`tie`), as at the start."""
        wanted = [u for u in dict.fromkeys(uuids) if u not in self.uuids]
        if not wanted:
            return True
        if self.broker is not None:
            try:
                got = broker_client.lease(self.broker, self.run_id, wanted, None)
            except NoResources:
                return False
            self._brokered.extend(got)
            return True
        ld = lease_dir(self.lock_dir)
        record = _holder_record(self.run_id)
        taken: list[_HeldLock] = []
        try:
            for uuid in wanted:
                held = _lock_one(ld, uuid, record)
                if held is None:
                    break
                taken.append(held)
        except BaseException:
            self._held.extend(taken)
            self.release_some(h.uuid for h in taken)
            raise
        self._held.extend(taken)
        if len(taken) < len(wanted):
            self.release_some(h.uuid for h in taken)
            return False
        return True

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


def _drop(held: _HeldLock, *, unlock: bool) -> None:
    """Give up one held lease: its holder note and file text first, so nobody reads them as current, then the
    descriptor. ``unlock``: take the lock off the open file description itself (``LOCK_UN``), so that copies of the
    descriptor (the process backend's master inherits them) do not keep it; without it the lock lives on in such a
    copy, as a run's leases must while its master checkpoints after the launcher let go."""
    if held.note is not None:
        with contextlib.suppress(OSError):
            held.note.unlink()
    try:
        os.ftruncate(held.fd, 0)
    except OSError:
        pass  # opened read-only (the admin store, or someone else's file mode); nothing was written
    if unlock:
        fcntl.flock(held.fd, fcntl.LOCK_UN)
    os.close(held.fd)  # closing the last descriptor releases the flock


def _holder_record(run_id: str) -> dict[str, Any]:
    """What a lease file (single-user mode) and its holder note say of the run holding it: labels only, the kernel
    says who holds it (:mod:`launcher.gpu.leaseholders`)."""
    return {"schema": LOCK_SCHEMA, "run_id": run_id, "pid": os.getpid(), "user": user_name(os.getuid()),
            "host": socket.gethostname(), "since": time.time()}


def ensure_shared_dir(directory: Path) -> None:
    """Single-user mode: make the lock (or queue) directory, world-writable and sticky like /tmp."""
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
            hint=f"set {LOCK_DIR_ENV} to a directory every user of this machine can write (mode 1777), or ask "
            "the administrator for a lease store (`sudo launcher admin init`)",
        ) from exc


def _open_store_file(path: Path, uuid: str) -> int:
    """Open an admin store lease file read-only (flock needs no write access); it must be root's."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise MissingDependency(f"GPU {uuid} has no lease file in the admin store ({path})",
                                hint="ask the administrator to run `sudo launcher admin init` again "
                                "(it makes one per GPU and MIG instance it finds)") from None
    except OSError as exc:
        raise InsecureSite(f"cannot open the lease file {path}: {exc.strerror}",
                           hint="ask the administrator to run `sudo launcher admin init` again") from None
    st = os.fstat(fd)
    if st.st_uid != 0 or st.st_mode & 0o022 or not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise InsecureSite(f"the lease file {path} is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):04o}; "
                           "it must be root's and writable by root only",
                           hint="ask the administrator to run `sudo launcher admin init` again")
    return fd


def _open_lock_file(path: Path) -> tuple[int, bool]:
    """Single-user mode: open (creating) a lock file without following symlinks; (fd, writable)."""
    flags = os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # a planted FIFO must not block the open
    try:
        fd = os.open(path, flags | os.O_RDWR, 0o666)
        writable = True
    except PermissionError:
        # Another user's file made without group/other write: the lock still works on a read-only fd.
        fd, writable = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK), False
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BadInput(f"GPU lock file {path} is a symlink; refusing to follow it",
                           hint="remove it; someone may be tampering with the lock directory") from exc
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise BadInput(f"GPU lock file {path} is not a regular file (mode {st.st_mode:o}, owner uid {st.st_uid}); "
                       "refusing to use it", hint="remove it; someone may be tampering with the lock directory")
    if not writable:
        return fd, False
    try:
        if os.fstat(fd).st_uid == os.getuid():
            os.fchmod(fd, 0o666)  # the umask took write from other users; they must be able to lock it too
    except OSError:
        pass
    return fd, True


def _try_lock(fd: int) -> bool:
    """Take the exclusive lock without waiting. A shared-lock probe does not count as busy."""
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


def _lock_one(ld: LeaseDir, uuid: str, record: dict[str, Any]) -> _HeldLock | None:
    """Lease one GPU's file; None when another run holds it."""
    path = _lock_path(ld.path, uuid)
    while True:
        if ld.site is not None:
            fd, writable = _open_store_file(path, uuid), False
        else:
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
        note = write_note(ld.site.holders, uuid, record) if ld.site is not None else None
        return _HeldLock(uuid, path, fd, note)


def reserve(
    uuids: Iterable[str],
    run_id: str,
    lock_dir: str | Path | None = None,
    *,
    count: int | None = None,
) -> Reservation:
    """Lease GPUs for a run, for as long as the returned :class:`Reservation` (or the process) lives.

    Never waits: a GPU held by another run is busy now. Use as a context manager, or call ``.release()``.

    Args:
        uuids: GPU UUIDs, in order of preference.
        run_id: this run's id, recorded in the holder note for ``launcher gpus``.
        lock_dir: single-user mode's lock directory (None: ``$LAUNCHER_LOCK_DIR`` or ``/tmp/launcher-locks``);
            with an admin store it must be None or the store's.
        count: None: all of ``uuids`` or nothing. N: the first N that are free, in the given order.

    Raises:
        NoResources: a GPU is held by another run (``count`` None), or fewer than ``count`` are free. The
            message names the holders. Nothing stays locked.
        BadInput: a malformed UUID, a lock directory that cannot be created or that bypasses the store.
        MissingDependency: the admin store has no lease file for a GPU.
    """
    wanted = list(dict.fromkeys(uuids))
    need = len(wanted) if count is None else count
    ld = lease_dir(lock_dir)
    if ld.site is not None and ld.site.broker is not None:
        return _reserve_brokered(ld, ld.site.broker, wanted, run_id, count)
    if ld.site is None:
        ensure_shared_dir(ld.path)
    record = _holder_record(run_id)
    reservation = Reservation(run_id, ld.path)
    busy: list[str] = []
    try:
        for uuid in wanted:
            if len(reservation._held) >= need:
                break
            held = _lock_one(ld, uuid, record)
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
        from launcher.gpu import leaseholders  # here, not at the top: leaseholders imports this module

        holders = {h.uuid: h for h in leaseholders.list_holders(ld)}
        who = "; ".join(f"{u} held by {holders[u].describe() if u in holders else 'another run'}" for u in busy)
        raise NoResources(
            f"could not reserve {need} GPU(s) for run {run_id} among {len(wanted)}: {who or 'none free'}",
            hint="wait for those runs to end (`launcher gpus` shows them; `launcher up --wait` queues), or choose "
            "other GPUs with --gpus",
        )
    logger.info("run %s reserved %s in %s", run_id, ", ".join(reservation.uuids), ld.path)
    return reservation


def _reserve_brokered(ld: LeaseDir, broker: Path, wanted: list[str], run_id: str, count: int | None) -> Reservation:
    """:func:`reserve` through the lease broker: it counts this user's leases against the site cap and takes the
    locks in one step, tied to this process (:mod:`launcher.gpu.broker_client` raises its refusals)."""
    reservation = Reservation(run_id, ld.path, broker=broker)
    if not wanted or count == 0:
        return reservation
    for uuid in wanted:
        _lock_path(ld.path, uuid)  # a malformed UUID is BadInput here, as without a broker
    reservation._brokered = broker_client.lease(broker, run_id, wanted, count)
    logger.info("run %s leased %s through the broker at %s", run_id, ", ".join(reservation.uuids), broker)
    return reservation
