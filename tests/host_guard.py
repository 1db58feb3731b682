"""Pytest plugin: the suite neither uses nor changes the host's admin lease store, site policy or users.

Why (issue 24): where an administrator ran ``launcher admin init``, ``/etc/launcher/site.toml`` makes every
launcher lease its GPUs in ``/var/lib/launcher`` and refuse a ``--lock-dir`` or ``$LAUNCHER_LOCK_DIR`` of its
own (the product's rule, which no test may weaken), and ``/etc/launcher/policy.toml`` caps every run. Most
tests need a lock directory, a store or a policy of their own. So, as root (CI runs as root), the test process
moves at start, before any test or thread, into a private mount namespace in which ``/etc/launcher`` and
``/var/lib/launcher``, where they exist, are covered by empty root-owned directories of the session's own
(propagation ``slave``: the host's later mounts still show in it, its mounts never reach the host). Every
process a test starts (launchers, masters, the test bed's daemons) inherits that view; nothing is bypassed,
the launcher simply finds no admin store, as on a machine without one.

Docker: the default engine resolves bind-mount sources in the host's mount namespace, not the suite's. The
suite keeps its stores and lock directories under /tmp (pytest's ``tmp_path``, ``tempfile``), which both see,
and never puts anything under the covered paths (dockerd would take them for the host's real ones).

The host's originals stay readable in the namespace through read-only bind mounts (:func:`host_views`): for
the tests about the real store, and for the end check, which compares ``/etc/launcher``, ``/var/lib/launcher``
(and a store or policy the host's site file names elsewhere) and the user files with a snapshot taken at the
start, byte for byte, and fails the session naming what changed.

Not root, or no mount namespace to be had: nothing is covered, and with ``/etc/launcher`` present the tests
that need leases of their own skip (:func:`skip_beside_an_admin_store`) with a reason naming it.
"""

from __future__ import annotations

import contextlib
import ctypes
import difflib
import hashlib
import os
import re
import shutil
import stat
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ETC = Path("/etc/launcher")
STORE = Path("/var/lib/launcher")
SITE_FILE = ETC / "site.toml"
USER_FILES = tuple(Path(p) for p in ("/etc/passwd", "/etc/group", "/etc/shadow", "/etc/gshadow",
                                     "/etc/subuid", "/etc/subgid"))
# Runtime state other users' runs write into a shared store while the suite runs (lease notes, wait tickets).
LIVE_DIRS = ("holders", "queue")
TEST_USER = re.compile(r"^lt(\d+)[a-z]$")  # see unix_user_name

_CLONE_NEWNS = 0x00020000
_MS_RDONLY, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_SLAVE = 1, 32, 4096, 16384, 1 << 19
_MNT_DETACH = 2


@dataclass
class _Guard:
    """What this session did: which paths it covered, where the host's originals are, what it saw at start."""

    paths: list[Path] = field(default_factory=list)  # the host's admin paths, as found at start
    scratch: Path | None = None
    views: dict[Path, Path] = field(default_factory=dict)  # covered path -> read-only view of the host's original
    mounted: list[Path] = field(default_factory=list)  # every mount made, in order
    why_not: str | None = None  # why nothing was covered (None: covered, or nothing to cover)
    before: dict[str, str] = field(default_factory=dict)
    users_before: dict[Path, bytes | None] = field(default_factory=dict)
    other_uids: frozenset[int] = frozenset()
    report: list[tuple[str, bool]] = field(default_factory=list)  # (line, whether it fails the session)
    workers: set[int] = field(default_factory=set)  # pytest-xdist: this session's workers' pids (their users are ours)
    failed_in_worker: bool = False


_guard = _Guard()


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _mount(source: str | None, target: Path, flags: int) -> None:
    if _libc().mount(None if source is None else source.encode(), str(target).encode(), None, flags, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def guarded_paths() -> list[Path]:
    """The host's admin paths: /etc/launcher, /var/lib/launcher, and a store or policy its site file names
    elsewhere (read before anything is covered)."""
    paths = [ETC, STORE]
    try:
        site = tomllib.loads(SITE_FILE.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        site = {}
    for key in ("store", "policy"):
        value = site.get(key)
        if isinstance(value, str) and value and not any(Path(value).is_relative_to(p) for p in paths):
            paths.append(Path(value))
    return paths


def _describe(entry: str) -> str:
    st = os.lstat(entry)
    what = (f"link -> {os.readlink(entry)}" if stat.S_ISLNK(st.st_mode)
            else f"sha256 {hashlib.sha256(Path(entry).read_bytes()).hexdigest()}" if stat.S_ISREG(st.st_mode)
            else "dir" if stat.S_ISDIR(st.st_mode) else f"type {stat.S_IFMT(st.st_mode):o}")
    return f"{what} mode {stat.S_IMODE(st.st_mode):04o} uid {st.st_uid} gid {st.st_gid}"


def snapshot(root: Path, shown_as: Path | None = None) -> dict[str, str]:
    """Every entry under ``root`` (walked without following links): type, mode, owner, and the content's
    SHA-256 or the link's target. Keys are paths as the host names them (``shown_as``)."""
    name = shown_as or root
    if not os.path.lexists(root):
        return {str(name): "absent"}
    if os.path.islink(root) or not os.path.isdir(root):
        return {str(name): _describe(str(root))}
    found: dict[str, str] = {}
    for here, dirs, files in os.walk(root):  # symbolic links to directories are listed, not followed
        links = [d for d in dirs if os.path.islink(os.path.join(here, d))]
        for entry in [here, *(os.path.join(here, f) for f in [*files, *links])]:
            found[str(name / os.path.relpath(entry, root))] = _describe(entry)
    return found


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _isolate(paths: list[Path]) -> str | None:
    """Cover each existing path in ``paths`` in a new mount namespace; None on success, else why nothing was.

    Raises:
        pytest.UsageError: a mount failed halfway (the session would see part of the host's store).
    """
    if os.geteuid() != 0:
        return "not root: a private mount namespace needs CAP_SYS_ADMIN (CI runs as root)"
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        return f"the test process already has {threads} threads; a mount namespace is per process"
    if _libc().unshare(_CLONE_NEWNS) != 0:
        return f"unshare(CLONE_NEWNS) failed: {os.strerror(ctypes.get_errno())}"
    scratch = Path(tempfile.mkdtemp(prefix="launcher-suite-ns-", dir="/tmp"))
    os.chmod(scratch, 0o755)
    _guard.scratch = scratch
    try:
        _mount(None, Path("/"), _MS_REC | _MS_SLAVE)  # nothing mounted from here on reaches the host
        for i, path in enumerate(paths):
            view, own = scratch / f"host-{i}", scratch / f"own-{i}"
            if path.is_dir():
                view.mkdir()
                own.mkdir(mode=0o755)
            else:
                view.touch()
                own.touch(mode=0o644)
            _mount(str(path), view, _MS_BIND | _MS_REC)
            _guard.mounted.append(view)
            _mount(None, view, _MS_BIND | _MS_REMOUNT | _MS_RDONLY)
            _mount(str(own), path, _MS_BIND)
            _guard.mounted.append(path)
            _guard.views[path] = view
    except OSError as exc:
        raise pytest.UsageError(f"tests/host_guard.py: cannot hide the host's admin paths {paths} in a private "
                                f"mount namespace: {exc}") from None
    return None


def host_views() -> dict[Path, Path]:
    """Each covered path -> where the host's original can be read (read-only); empty: nothing covered."""
    return dict(_guard.views)


def covered() -> bool:
    """Whether this session hides the host's admin paths (else they are what the launcher sees, if any)."""
    return bool(_guard.views)


def skip_beside_an_admin_store() -> None:
    """Skip a test that needs leases, a store or a policy of its own where the host's admin paths are in
    view (the suite could not cover them): the launcher would rightly refuse its lock directory."""
    if not covered() and os.path.lexists(ETC):
        pytest.skip(f"this machine has {ETC} (an admin lease store or site policy) and the suite could not hide "
                    f"it ({_guard.why_not}); a lock directory of the test's own would be refused")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Snapshot the host's admin paths and user files, then cover the paths (before any thread exists)."""
    if _guard.paths:  # once per process
        return
    _guard.paths = guarded_paths()
    for p in _guard.paths:
        _guard.before.update(snapshot(p))
    _guard.users_before = {p: _read(p) for p in USER_FILES}
    passwd = (_guard.users_before[USER_FILES[0]] or b"").splitlines()
    _guard.other_uids = frozenset(int(f[2]) for f in (line.split(b":") for line in passwd)
                                  if len(f) > 3 and f[2].isdigit() and f[2] != b"0")
    existing = [p for p in _guard.paths if os.path.lexists(p)]
    if existing:
        _guard.why_not = _isolate(existing)


def _changes() -> tuple[list[str], list[str]]:
    """(changes the suite may have made, changes it did not: other users' runs in the store's live directories,
    and another test session's users on a shared machine)."""
    after: dict[str, str] = {}
    for p in _guard.paths:
        after.update(snapshot(_guard.views.get(p, p), shown_as=p))
    ours: list[str] = []
    theirs: list[str] = []
    for path in sorted(set(_guard.before) | set(after)):
        old, new = _guard.before.get(path, "absent"), after.get(path, "absent")
        if old == new:
            continue
        uids = {int(s.split(" uid ")[1].split()[0]) for s in (old, new) if " uid " in s}
        live = any(f"/{d}/" in path for d in LIVE_DIRS)
        (theirs if live and uids and uids <= _guard.other_uids else ours).append(f"{path}: {old} -> {new}")
    for p, old_bytes in _guard.users_before.items():
        new_bytes = _read(p)
        if new_bytes == old_bytes:
            continue
        diff = [d for d in difflib.unified_diff((old_bytes or b"").decode(errors="replace").splitlines(),
                                                (new_bytes or b"").decode(errors="replace").splitlines(),
                                                lineterm="", n=0) if d[:1] in "+-" and d[:3] not in ("+++", "---")]
        others = [d for d in diff if _another_sessions_user(d[1:].split(":", 1)[0])]
        for lines, where in ((others, theirs), ([d for d in diff if d not in others], ours)):
            if lines:
                where.append(f"{p}: " + "; ".join(lines))
    return ours, theirs


def unix_user_name(letter: str) -> str:
    """The name of a Unix user a test makes (tests/unit/gpu/test_gpu_users.py): ``lt<pid % 100000><letter>``,
    so the end check can tell another test session's users, made and removed meanwhile, from this one's."""
    return f"lt{os.getpid() % 100000}{letter}"


def _another_sessions_user(name: str) -> bool:
    match = TEST_USER.match(name)
    mine = {os.getpid() % 100000} | {pid % 100000 for pid in _guard.workers}
    return match is not None and int(match.group(1)) not in mine


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """pytest-xdist, in the controller: a worker's own check (its users are its pid's) joins this session's report,
    and the worker's users count as this session's in the final check (by then every worker has finished)."""
    out = getattr(node, "workeroutput", None) or {}
    if isinstance(out.get("host_guard_pid"), int):
        _guard.workers.add(out["host_guard_pid"])
    for line, bad in out.get("host_guard", ()):
        if bad:
            _guard.report.append((f"[{getattr(getattr(node, 'gateway', None), 'id', 'worker')}] {line}", True))
            _guard.failed_in_worker = True


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Fail the session when the host's admin paths or user files differ from the start."""
    if hasattr(session.config, "workeroutput"):  # an xdist worker: the controller reports and fails the session
        ours, _ = _changes()
        session.config.workeroutput["host_guard_pid"] = os.getpid()
        session.config.workeroutput["host_guard"] = [("host check FAILED: the suite changed the host's admin paths or "
                                                      "users: " + " | ".join(ours), True)] if ours else []
        return
    if _guard.failed_in_worker:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    ours, theirs = _changes()
    hidden = f" (hidden from the tests in a private mount namespace: {', '.join(map(str, _guard.views))})"
    if theirs:
        _guard.report.append(("host check: changed meanwhile by others (other users' runs, another test session): "
                              + " | ".join(theirs), False))
    if ours:
        _guard.report.append(("host check FAILED: the suite changed the host's admin paths or users: "
                              + " | ".join(ours), True))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    else:
        _guard.report.append(("host check: /etc/launcher, /var/lib/launcher and the user files are as before"
                              + (" but for the changes of others above" if theirs else "")
                              + (hidden if covered() else ""), False))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for line, bad in _guard.report:
        terminalreporter.write_line(line, red=bad)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Unmount the session's views and covers (its namespace only), then remove their directories; never
    recursively where a host's original was mounted (a view that failed to unmount stays, unharmed)."""
    if _guard.scratch is None:
        return
    for target in reversed(_guard.mounted):
        _libc().umount2(str(target).encode(), _MNT_DETACH)
    for entry in sorted(_guard.scratch.iterdir()):
        if os.path.ismount(entry):
            continue
        with contextlib.suppress(OSError):
            if entry.name.startswith("own-") and entry.is_dir():
                shutil.rmtree(entry)  # the session's own directory, shown at the host's path
            else:
                (entry.rmdir if entry.is_dir() else entry.unlink)()
    with contextlib.suppress(OSError):
        _guard.scratch.rmdir()
    _guard.scratch = None
    _guard.views.clear()
    _guard.mounted.clear()
