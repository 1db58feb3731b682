"""Host-side access to a run directory that the run's containers can write.

The master container mounts ``<results>/<run>/`` read-write, so anything below it may be a planted symbolic
link (``logs/master.log -> ~/.ssh/authorized_keys``), a FIFO (a read that never returns), a link to
``/dev/zero`` (a read that never ends), a huge file, or bytes that are not UTF-8. Every time the launcher
reads or writes there it goes through this module, which:

* walks each path component relative to the directory descriptor of the one before, with ``O_NOFOLLOW``
  (a link anywhere below the run directory is refused, not followed);
* opens with ``O_NONBLOCK`` and then ``fstat``\\ s the descriptor: only regular files are read or written
  (a FIFO or device is refused before any read could block);
* caps what it reads (``max_bytes``) and refuses to append to a file with more than one hard link;
* changes ownership through the descriptor (``fchown``), never through a path.

The run directory itself is trusted: the user named it (or the launcher made it), and a container cannot
replace its own mount point. Failures are :class:`UnsafeFile` (an ``OSError``, so callers that already
handle I/O errors keep working) whose message names the file and what was wrong with it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

log = logging.getLogger(__name__)

MAX_JSON_BYTES = 8 * 1024 * 1024  # status.json, run.json, summary.json, spec.json: a few KiB in practice
MAX_LOG_BYTES = 64 * 1024 * 1024  # what `launcher logs` reads of one kept log (its end)
# O_PATH: a directory is walked, never read, so one the caller may search but not list (the lease store's
# ``holders/``, mode 1733) can be walked too.
_DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


class UnsafeFile(OSError):
    """A file under a run directory that the launcher refuses to touch (a link, not a regular file, too big),
    or could not open. ``reason`` says which, for a message a person can act on."""

    def __init__(self, path: Path, reason: str, err: int = errno.EPERM) -> None:
        super().__init__(err, f"{path}: {reason}")
        self.path = path
        self.reason = reason

    def __str__(self) -> str:
        return f"refusing {self.path}: {self.reason}"


def _parts(rel: str | Path) -> list[str]:
    parts = [p for p in PurePosixPath(rel).parts if p not in ("", ".")]
    if not parts or any(p in ("..", "/") for p in parts):
        raise ValueError(f"not a relative path below a run directory: {rel!r}")
    return parts


def _open_dir_chain(root: Path, parts: list[str], *, create: bool) -> int:
    """A descriptor of ``root/parts...`` (directories), each step with ``O_NOFOLLOW``; ``create``: make
    missing ones (mode 0755)."""
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in parts:
            try:
                nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(name, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
                nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_beneath(root: Path, rel: str | Path, flags: int, mode: int = 0o644, *, create_dirs: bool = False) -> int:
    """Open ``root/rel`` without following a link anywhere below ``root``; a regular file only.

    Args:
        root: the run directory (trusted).
        rel: a relative path below it, e.g. ``"logs/master.log"``.
        flags: ``os.O_RDONLY`` or write flags (``O_WRONLY | O_APPEND | O_CREAT``); ``O_NOFOLLOW``,
            ``O_NONBLOCK`` and ``O_CLOEXEC`` are always added.
        create_dirs: make missing directories on the way.
    Returns: the descriptor (the caller closes it).
    Raises:
        FileNotFoundError: it (or a directory on the way) does not exist.
        UnsafeFile: a link, a FIFO, a device, a directory, or any other failure to open it.
    """
    parts = _parts(rel)
    path = root / Path(*parts)
    try:
        dfd = _open_dir_chain(root, parts[:-1], create=create_dirs)
    except FileNotFoundError:
        raise
    except OSError as exc:
        reason = "a symbolic link on the way" if exc.errno in (errno.ELOOP, errno.ENOTDIR) else exc.strerror
        raise UnsafeFile(path, str(reason), exc.errno or errno.EPERM) from None
    try:
        fd = os.open(parts[-1], flags | _FILE_FLAGS, mode, dir_fd=dfd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFile(path, "a symbolic link (not followed)", exc.errno) from None
        if exc.errno == errno.ENXIO:
            raise UnsafeFile(path, "a FIFO or socket, not a regular file", exc.errno) from None
        raise UnsafeFile(path, str(exc.strerror), exc.errno or errno.EPERM) from None
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(path, f"not a regular file ({_kind(st.st_mode)})")
        if flags & (os.O_WRONLY | os.O_RDWR) and st.st_nlink > 1:
            raise UnsafeFile(path, f"has {st.st_nlink} hard links; the launcher writes only to its own files")
        # Regular files ignore O_NONBLOCK; clear it anyway so nothing later depends on it.
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def read_bytes(root: Path, rel: str | Path, *, max_bytes: int = MAX_JSON_BYTES,
               owner_uid: int | None = None) -> bytes:
    """The whole of ``root/rel``, a regular file of at most ``max_bytes`` bytes (owned by ``owner_uid``, when
    given). Everything is checked on the open descriptor before the first read, so a FIFO, a device, a huge
    sparse file or another user's file costs one ``open`` and one ``fstat``, never a blocked or unbounded read.

    Raises: FileNotFoundError; UnsafeFile (see :func:`open_beneath`, larger than ``max_bytes``, or owned by
    another uid).
    """
    fd = open_beneath(root, rel, os.O_RDONLY)
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        size = st.st_size
        if owner_uid is not None and st.st_uid != owner_uid:
            raise UnsafeFile(root / rel, f"owned by uid {st.st_uid}, not by uid {owner_uid}")
        if size > max_bytes:
            raise UnsafeFile(root / rel, f"{size} bytes, more than the {max_bytes} the launcher reads")
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:  # grew while being read
        raise UnsafeFile(root / rel, f"more than the {max_bytes} bytes the launcher reads")
    return data


def load_json(root: Path, rel: str | Path, *, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """``root/rel`` parsed as JSON. Raises FileNotFoundError, or UnsafeFile for anything else wrong with it
    (unsafe, too big, not UTF-8, not JSON, nested too deep)."""
    data = read_bytes(root, rel, max_bytes=max_bytes)
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise UnsafeFile(root / rel, "not UTF-8 text", errno.EINVAL) from None
    except (ValueError, RecursionError) as exc:
        raise UnsafeFile(root / rel, f"not JSON ({type(exc).__name__})", errno.EINVAL) from None


def read_json(root: Path, rel: str | Path, *, max_bytes: int = MAX_JSON_BYTES) -> dict[str, Any] | None:
    """A JSON object from ``root/rel`` (every file the launcher reads there is one), or None when the file is
    missing or unreadable (a warning says why: a link, a FIFO, too big, not UTF-8, not a JSON object): for
    the live files the master rewrites (``status.json``) a caller shows nothing and carries on."""
    try:
        doc = load_json(root, rel, max_bytes=max_bytes)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("%s", exc)
        return None
    if not isinstance(doc, dict):
        log.warning("refusing %s: a JSON %s, not an object", root / rel, type(doc).__name__)
        return None
    return doc


def read_json_at(path: Path, *, max_bytes: int = MAX_JSON_BYTES) -> dict[str, Any] | None:
    """:func:`read_json` of a file directly in a run directory, given its full path."""
    return read_json(path.parent, path.name, max_bytes=max_bytes)


def read_tail(root: Path, rel: str | Path, *, max_bytes: int = MAX_LOG_BYTES) -> bytes:
    """The last ``max_bytes`` bytes of the regular file ``root/rel`` (a log), with a note when the start was
    left out. Raises FileNotFoundError or UnsafeFile."""
    fd = open_beneath(root, rel, os.O_RDONLY)
    with os.fdopen(fd, "rb") as fh:
        size = os.fstat(fd).st_size
        if size <= max_bytes:
            return fh.read(max_bytes)
        fh.seek(size - max_bytes)
        return f"--- launcher: first {size - max_bytes} bytes left out ---\n".encode() + fh.read(max_bytes)


@contextmanager
def open_read(root: Path, rel: str | Path) -> Iterator[Any]:
    """A binary file object of ``root/rel`` (a regular file, opened without following links), e.g. a log
    to stream; the caller bounds how much it reads."""
    fd = open_beneath(root, rel, os.O_RDONLY)
    with os.fdopen(fd, "rb") as fh:
        yield fh


def open_append(root: Path, rel: str | Path, *, owner: tuple[int, int] | None = None) -> int:
    """A descriptor appending to ``root/rel`` (created 0644 if missing, directories on the way too), e.g. a
    child's log. ``owner``: (uid, gid) to ``fchown`` it to (a root launcher hands its files to the run's
    user). Raises UnsafeFile (or FileNotFoundError when ``root`` is gone)."""
    fd = open_beneath(root, rel, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644, create_dirs=True)
    if owner is not None:
        try:
            os.fchown(fd, *owner)
        except OSError as exc:
            log.warning("cannot hand %s to uid %d: %s", root / rel, owner[0], exc.strerror)
    return fd


def append(root: Path, rel: str | Path, data: bytes, *, owner: tuple[int, int] | None = None,
           cap_bytes: int | None = None) -> None:
    """Append ``data`` to ``root/rel`` through :func:`open_append` (never through a planted link).

    ``cap_bytes``: the file never grows past about this size: when ``data`` would take it there, what it holds
    is first copied to ``<rel>.1`` (replacing an older copy) and it starts again, and of a ``data`` larger than
    the cap only its end is kept; a line saying so marks each cut.
    """
    fd = open_append(root, rel, owner=owner)
    with os.fdopen(fd, "ab") as fh:
        if cap_bytes is not None:
            size = os.fstat(fd).st_size
            if size and size + len(data) > cap_bytes:
                _keep_aside(root, rel, fd, owner)
                os.ftruncate(fd, 0)
                fh.write(f"--- launcher: {Path(rel).name} passed {cap_bytes} bytes; the earlier part is in "
                         f"{Path(rel).name}.1 ---\n".encode())
            if len(data) > cap_bytes:
                fh.write(f"--- launcher: the first {len(data) - cap_bytes} bytes of this part left out ---\n".encode())
                data = data[-cap_bytes:]
        fh.write(data)


def _keep_aside(root: Path, rel: str | Path, fd: int, owner: tuple[int, int] | None) -> None:
    """Copy ``root/rel`` (open for appending as ``fd``) to ``root/<rel>.1``, both through :func:`open_beneath`."""
    src = out = None
    try:
        src = open_beneath(root, rel, os.O_RDONLY)
        if os.fstat(src).st_ino != os.fstat(fd).st_ino:
            raise UnsafeFile(root / rel, "replaced while being kept aside")
        out = open_beneath(root, f"{rel}.1", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        if owner is not None:
            with contextlib.suppress(OSError):
                os.fchown(out, *owner)
        offset = 0
        while chunk := os.pread(src, 1 << 20, offset):
            os.write(out, chunk)
            offset += len(chunk)
    except OSError as exc:  # the cap holds anyway: the earlier part is lost rather than kept
        log.warning("cannot keep the earlier part of %s: %s", root / rel, exc)
    finally:
        for d in (src, out):
            if d is not None:
                os.close(d)


def distrust(path: Path, owner_uid: int | None = None) -> str | None:
    """Why the run directory ``path`` must not be trusted, or None when it may be: it is a link or not a
    directory, is writable by every user, or (``owner_uid`` given) is owned by neither that user nor root.

    A root launcher acting on a run (``down --all``, saving a container's output into the directory its
    labels name) acts only on directories the run's own user made and nobody else can change.
    """
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        return f"is writable by every user (mode {stat.S_IMODE(st.st_mode):o})"
    if owner_uid is not None and st.st_uid not in (owner_uid, 0):
        return f"is owned by uid {st.st_uid}, not by the run's user (uid {owner_uid})"
    return None


MAX_CHOWN_DEPTH = 32  # directory levels below the top that chown_tree descends (a run directory has ~4)


def chown_tree(top: Path, uid: int, gid: int) -> list[str]:
    """Give ``top`` and everything below it to ``uid``:``gid`` (like ``chown -R``), as root, without ever
    changing a file outside the tree.

    Root acting on a tree a user can write must not chown by path: a directory swapped for a symbolic link
    mid-walk would redirect every later path (``follow_symlinks=False`` guards only the last component), and a
    hard link would hand over the file it links to (``/etc/shadow`` from the same file system). So the walk
    holds a descriptor of each directory, opened relative to its parent with ``O_NOFOLLOW`` (a swapped-in
    link fails to open and is skipped), opens each entry with ``O_PATH|O_NOFOLLOW`` relative to that
    descriptor and changes the owner of what it opened, after ``fstat`` says it is a directory, or a file with
    exactly one link. Symbolic links themselves are left as they are.

    Returns: what was skipped and why, one line each, for a warning (empty when everything was given).
    """
    skipped: list[str] = []
    try:
        fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        return [f"{top}: cannot open it as a directory ({exc.strerror})"]
    _chown_dir(fd, top, uid, gid, 0, skipped)
    return skipped


def _chown_dir(fd: int, shown: Path, uid: int, gid: int, depth: int, skipped: list[str]) -> None:
    """Give the directory ``fd`` and its entries away, then close ``fd``."""
    try:
        os.fchown(fd, uid, gid)
        if depth >= MAX_CHOWN_DEPTH:
            skipped.append(f"{shown}: more than {MAX_CHOWN_DEPTH} levels deep; its entries are left as they are")
            return
        for name in os.listdir(fd):
            try:
                efd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as exc:
                skipped.append(f"{shown / name}: {exc.strerror}")
                continue
            try:
                st = os.fstat(efd)
                if stat.S_ISLNK(st.st_mode):
                    continue  # never followed; the link's own owner does not matter
                if stat.S_ISDIR(st.st_mode):
                    try:  # opened again to list it; a directory swapped for a link since fails here
                        dfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                    except OSError as exc:
                        skipped.append(f"{shown / name}: {exc.strerror}")
                        continue
                    if os.fstat(dfd).st_ino != st.st_ino:
                        os.close(dfd)
                        skipped.append(f"{shown / name}: replaced while being walked")
                        continue
                    _chown_dir(dfd, shown / name, uid, gid, depth + 1, skipped)
                elif st.st_nlink > 1:
                    skipped.append(f"{shown / name}: has {st.st_nlink} hard links (it may be another file's)")
                else:
                    # An O_PATH descriptor cannot be fchown()ed; its /proc/self/fd entry names the same inode.
                    os.chown(f"/proc/self/fd/{efd}", uid, gid)
            except OSError as exc:
                skipped.append(f"{shown / name}: {exc.strerror}")
            finally:
                os.close(efd)
    except OSError as exc:
        skipped.append(f"{shown}: {exc.strerror}")
    finally:
        os.close(fd)


def size_of(root: Path, rel: str | Path) -> int:
    """The size in bytes of the regular file ``root/rel``; 0 when it is missing or not one."""
    try:
        fd = open_beneath(root, rel, os.O_RDONLY)
    except OSError:
        return 0
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


__all__ = ["MAX_JSON_BYTES", "MAX_LOG_BYTES", "UnsafeFile", "append", "chown_tree", "distrust", "load_json",
           "open_append", "open_beneath", "open_read", "read_bytes", "read_json", "read_json_at", "read_tail", "size_of"]
