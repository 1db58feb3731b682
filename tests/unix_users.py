"""Unix users for the multi-user tests (the lease store, the broker, the stall tests): made with ``useradd``,
named by :func:`tests.host_guard.unix_user_name` so the session's end check tells them from another session's,
and removed again; their processes run with ``setpriv``. Also the one reason such a test is skipped."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from launcher.gpu import store
from tests.host_guard import unix_user_name


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int


def skip_reason(py: Path, *tools: str, needs: str = "a root-owned lease store") -> str | None:
    """Why a test that makes Unix users and ``needs`` cannot run here (None: it can): root, ``useradd``,
    ``userdel``, ``setpriv`` and ``tools``, a venv other users can execute, and no real lease store (which would
    make ``$LAUNCHER_SITE`` ignored)."""
    if os.geteuid() != 0:
        return f"needs root (CI runs as root): it creates Unix users and {needs}"
    for tool in ("useradd", "userdel", "setpriv", *tools):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    real = os.path.realpath(py)
    if real.startswith("/root/"):
        return (f"{py} resolves to {real}, which other users cannot execute; make the venv from /usr/bin/python3.11 "
                "(scripts/setup.sh does)")
    if os.path.lexists(store.SITE_FILE):
        return f"this machine has a real lease store ({store.SITE_FILE}); $LAUNCHER_SITE would be ignored"
    return None


def add_user(letter: str) -> User:
    """Make the session's user ``letter`` (no home, no login shell)."""
    name = unix_user_name(letter)
    subprocess.run(["useradd", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin", name],
                   check=True, capture_output=True)
    pw = pwd.getpwnam(name)
    return User(name, pw.pw_uid, pw.pw_gid)


def remove_users(names: list[str]) -> None:
    for name in names:
        subprocess.run(["userdel", name], capture_output=True)
