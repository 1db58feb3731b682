"""The admin-provisioned lease store: where GPU leases live when several users share a machine.

``launcher admin init`` (root, once) writes the site file ``/etc/launcher/site.toml``::

    store = "/var/lib/launcher"            # root 0755
    policy = "/etc/launcher/policy.toml"   # the site policy (authoritative)
    broker = "/run/launcher/broker.sock"   # only with `admin init --broker`: the lease broker's socket

and makes the store: ``leases/`` (root 0755) holding one lock file per GPU and MIG instance UUID (root
0644: users open them read-only and ``flock`` them, which needs no write access, and nobody but root can
delete or replace them), ``queue/`` (root 1777, sticky: users create their own wait tickets, cannot remove
other users', and can list them all, which the queue order needs; 1733 would hide the queue from its
waiters), and ``holders/`` (1733: a note per lease naming the run, opened by name, trusted only for the uid
that owns it).

With ``broker`` (:mod:`launcher.gpu.broker`), the lease files are root 0600 instead: no user can open, hence
``flock``, them; the root-run broker takes every lease, the per-user cap and the locks in one step.

Without a site file the launcher works as before for one user (lock files in ``$LAUNCHER_LOCK_DIR`` or
``/tmp/launcher-locks``) and says so in one line.

Tests and image builds need a store in a temporary directory: ``$LAUNCHER_SITE`` names another site file,
honoured only when ``/etc/launcher/site.toml`` does not exist and that file, and every directory above it, is
owned by root and writable by nobody else. An unprivileged user can therefore not point the launcher at a
store of their own: only root can make a file that passes.
"""

from __future__ import annotations

import os
import re
import stat
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from launcher.errors import BadInput, LauncherError

SITE_FILE = Path("/etc/launcher/site.toml")
SITE_ENV = "LAUNCHER_SITE"
DEFAULT_STORE = Path("/var/lib/launcher")
DEFAULT_POLICY = Path("/etc/launcher/policy.toml")
LEASES, QUEUE, HOLDERS = "leases", "queue", "holders"
NO_STORE_NOTE = ("no admin lease store (/etc/launcher/site.toml): GPU leases hold between this user's runs only; "
                 "`sudo launcher admin init` makes them hold between users")


def no_broker_note(cap: int) -> str:
    """The plan's one line when the site caps GPUs per user but no lease broker enforces it."""
    return (f"no lease broker: the site's max_gpus_per_user = {cap} is counted by each launcher, not enforced (two "
            "launchers started together may exceed it); `sudo launcher admin init --broker "
            "/run/launcher/broker.sock` and `launcher admin broker` enforce it")


# What may name a lease file: GPU-/MIG- UUIDs, no path separators. Here, beside the store that holds one file per
# UUID, so that both this module and launcher.gpu.reservations check names without importing each other.
_UUID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def valid_uuid(uuid: str) -> bool:
    """Whether ``uuid`` can name a lease file (GPU-/MIG- UUIDs; no path separators)."""
    return bool(_UUID_RE.match(uuid))


class InsecureSite(LauncherError):
    """The site file or store can be changed by someone other than root: refuse rather than trust it."""

    exit_code = BadInput.exit_code


@dataclass(frozen=True)
class Site:
    """The administrator's setup, as found on this machine."""

    site_file: Path
    store: Path
    policy: Path
    broker: Path | None = None  # the lease broker's socket; None: users flock the lease files themselves

    @property
    def leases(self) -> Path:
        return self.store / LEASES

    @property
    def queue(self) -> Path:
        return self.store / QUEUE

    @property
    def holders(self) -> Path:
        return self.store / HOLDERS

    def lease_path(self, uuid: str) -> Path:
        return self.leases / f"{uuid}.lock"


def _root_only(path: Path, what: str) -> None:
    """Raise InsecureSite unless ``path`` and each directory above it is root's and not writable by others
    (a sticky directory such as /tmp may be world-writable: its entries cannot be replaced by others)."""
    p = path
    while True:
        try:
            st = os.lstat(p)
        except OSError as exc:
            raise InsecureSite(f"{what} {path}: cannot check {p}: {exc.strerror}") from None
        sticky_dir = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX and p != path
        if st.st_uid != 0 or (st.st_mode & 0o022 and not sticky_dir) or stat.S_ISLNK(st.st_mode):
            raise InsecureSite(
                f"{what} {path} is not trustworthy: {p} is owned by uid {st.st_uid} with mode "
                f"{stat.S_IMODE(st.st_mode):04o} (it must be root's and writable by root only)",
                hint="ask the administrator to run `launcher admin init` again, which fixes owners and modes")
        if p.parent == p:
            return
        p = p.parent


def _read_site_file(path: Path) -> Site:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise BadInput(f"cannot read the site file {path}: {exc}",
                       hint="ask the administrator to run `launcher admin init` again") from None
    unknown = sorted(set(data) - {"store", "policy", "broker"})
    if unknown or any(not isinstance(data.get(k, ""), str) for k in ("store", "policy", "broker")):
        raise BadInput(f"the site file {path} has unexpected content (keys {sorted(data)}); expected "
                       "store = \"/var/lib/launcher\", policy = \"/etc/launcher/policy.toml\" and optionally "
                       "broker = \"/run/launcher/broker.sock\"",
                       hint="ask the administrator to fix it or run `launcher admin init` again")
    return Site(site_file=path, store=Path(data.get("store") or DEFAULT_STORE),
                policy=Path(data.get("policy") or DEFAULT_POLICY),
                broker=Path(data["broker"]) if data.get("broker") else None)


def find_site(environ: dict[str, str] | None = None) -> Site | None:
    """The admin's setup: ``/etc/launcher/site.toml``, else a root-owned ``$LAUNCHER_SITE``, else None.

    Raises:
        InsecureSite: the site file or the store is writable by someone other than root.
        BadInput: the site file cannot be read.
    """
    env = os.environ if environ is None else environ
    if os.path.lexists(SITE_FILE):
        path = SITE_FILE
    elif env.get(SITE_ENV):
        path = Path(env[SITE_ENV])
        try:
            _root_only(path, "$LAUNCHER_SITE")
        except InsecureSite:
            return None  # an override anyone could have made: not a site; the one-line note says so
    else:
        return None
    return site_from_file(path)


def site_from_file(path: Path) -> Site:
    """A site file (the one :func:`find_site` found, or one named on the command line: ``launcher admin broker
    --site``), trusted only when it and its store are root's and writable by root only.

    Raises:
        InsecureSite, BadInput: as :func:`find_site`.
    """
    _root_only(path, "site file")
    site = _read_site_file(path)
    _root_only(site.leases, "lease store")
    return site


# ------------------------------------------------------------------------------------------- admin init
@dataclass(frozen=True)
class InitReport:
    site: Site
    created: tuple[str, ...]  # paths made or fixed
    gpus: tuple[str, ...]  # UUIDs with a lease file


def _ensure_dir(path: Path, mode: int, made: list[str]) -> None:
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise BadInput(f"{path} exists and is not a directory", hint="move it away and run `launcher admin init` again")
    if not path.exists():
        path.mkdir(parents=True, mode=0o755)
        made.append(str(path))
    st = path.stat()
    if st.st_uid != 0 or st.st_gid != 0 or stat.S_IMODE(st.st_mode) != mode:
        os.chown(path, 0, 0)
        os.chmod(path, mode)
        made.append(f"{path} (owner/mode fixed to root {mode:04o})")


def admin_init(uuids: Iterable[str], *, site_file: Path = SITE_FILE, store: Path = DEFAULT_STORE,
               policy: Path = DEFAULT_POLICY, broker: Path | None = None) -> InitReport:
    """Create (or repair) the lease store and the site file; idempotent. Root only.

    Args:
        uuids: the GPU and MIG instance UUIDs to make lease files for (``launcher admin init`` reads NVML).
        site_file, store, policy: where to put them (tests use temporary directories and ``$LAUNCHER_SITE``).
        broker: the lease broker's socket (:mod:`launcher.gpu.broker`): lease files become root 0600 (users
            cannot open them, so only the broker can lock them) and its directory root 0755. None: no
            broker, lease files root 0644 (users flock them themselves), as before.

    Raises:
        BadInput: not root, or a path in the way.
    """
    if os.geteuid() != 0:
        raise BadInput(f"`launcher admin init` must run as root (uid 0), not uid {os.geteuid()}",
                       hint="run it with sudo; it creates a root-owned lease store every user's launcher trusts")
    made: list[str] = []
    _ensure_dir(site_file.parent, 0o755, made)
    _ensure_dir(policy.parent, 0o755, made)
    _ensure_dir(store, 0o755, made)
    site = Site(site_file=site_file, store=store, policy=policy, broker=broker)
    _ensure_dir(site.leases, 0o755, made)
    _ensure_dir(site.queue, 0o1777, made)  # sticky; listable: every waiter must see the whole queue
    _ensure_dir(site.holders, 0o1733, made)
    if broker is not None:
        _ensure_dir(broker.parent, 0o755, made)  # the socket (0666) is made by the broker when it starts
    lease_mode = 0o600 if broker is not None else 0o644

    done = []
    for uuid in dict.fromkeys(uuids):
        if not valid_uuid(uuid):
            raise BadInput(f"not a GPU UUID: {uuid!r}")
        path = site.lease_path(uuid)
        if path.is_symlink():
            path.unlink()
        fd = os.open(path, os.O_CREAT | os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, lease_mode)
        try:
            st = os.fstat(fd)
            if st.st_uid != 0 or stat.S_IMODE(st.st_mode) != lease_mode:
                os.fchown(fd, 0, 0)
                os.fchmod(fd, lease_mode)
        finally:
            os.close(fd)
        done.append(uuid)
    if not policy.exists():
        policy.write_text("# Site policy (docs/gpus.md). Authoritative: users' own policies can only narrow it.\n"
                          "# max_gpus_per_user = 2\n# min_free_memory = \"8GiB\"\n# reserved_gpus = []\n"
                          "# max_workers_per_gpu = 32\n"
                          "# elastic = \"allow\"  # or \"default\" (runs yield groups to the queue unless --elastic off),"
                          " \"forbid\"\n", encoding="utf-8")
        os.chmod(policy, 0o644)
        made.append(str(policy))
    text = f'store = "{store}"\npolicy = "{policy}"\n' + (f'broker = "{broker}"\n' if broker is not None else "")
    if not site_file.exists() or site_file.read_text(encoding="utf-8") != text:
        tmp = site_file.with_name(f".{site_file.name}.{os.getpid()}")
        tmp.write_text(text, encoding="utf-8")
        os.chmod(tmp, 0o644)
        os.replace(tmp, site_file)
        made.append(str(site_file))
    return InitReport(site=site, created=tuple(made), gpus=tuple(done))
