"""A simulated admin-initialised machine for one test: a private mount namespace in which ``/etc/launcher`` and
``/var/lib/launcher`` are directories of the test's own (root; CI runs as root).

Why: the product's rule that an admin store refuses ``--lock-dir`` and ``$LAUNCHER_LOCK_DIR`` is about those
exact paths, and the host's must neither be needed nor touched (tests/host_guard.py hides them from the
suite). Each command runs in a fresh namespace (``unshare --mount --propagation private``): ``/etc`` and
``/var/lib`` become overlays whose upper layers live in the test's directory, only so that the two mount
points exist (nothing reaches the host's ``/etc`` or ``/var/lib``), and the test's directories are bound there.
What one command writes, the next sees; the test removes the directory at its end.

Not for Docker runs: dockerd resolves bind-mount sources in the host's namespace, where these paths are not
the test's, and the overlay on ``/var/lib`` hides mounts below it (``/var/lib/docker``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

from tests.helpers import ROOT, child_env, launcher_cmd

ETC, STORE = Path("/etc/launcher"), Path("/var/lib/launcher")
_SCRIPT = r"""set -e
b=$1; ro=$2; shift 2
for d in etc var-lib; do mkdir -p "$b/upper-$d/launcher" "$b/work-$d"; done
mount -t overlay overlay -o "lowerdir=/etc,upperdir=$b/upper-etc,workdir=$b/work-etc" /etc
mount -t overlay overlay -o "lowerdir=/var/lib,upperdir=$b/upper-var-lib,workdir=$b/work-var-lib" /var/lib
while [ "$1" != -- ]; do mount --bind $ro "$1" "$2"; shift 2; done
shift
exec "$@"
"""


def unavailable() -> str | None:
    """Why a simulated admin machine cannot be made here (for a skip), or None."""
    if os.geteuid() != 0:
        return "needs root (CI runs as root): a private mount namespace with the test's own /etc/launcher"
    for tool in ("unshare", "mount"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (util-linux)"
    return None


class AdminMachine:
    """``/etc/launcher`` and ``/var/lib/launcher`` as ``binds`` name them (target -> the directory shown there;
    default: two empty directories under ``base``), read-only when ``read_only``."""

    def __init__(self, base: Path, binds: dict[Path, Path] | None = None, *, read_only: bool = False) -> None:
        self.base = base
        self.binds = binds or {ETC: base / "etc-launcher", STORE: base / "var-lib-launcher"}
        self.read_only = read_only
        for own in self.binds.values():
            if own.is_relative_to(base):
                own.mkdir(mode=0o755, parents=True, exist_ok=True)

    def argv(self, *cmd: str) -> list[str]:
        pairs = [str(p) for target, own in self.binds.items() for p in (own, target)]
        return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", _SCRIPT, "admin-ns",
                str(self.base), "-o ro" if self.read_only else "", *pairs, "--", *cmd]

    def run(self, *cmd: str, env: Mapping[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """``cmd`` in this machine's namespace, from the repository root, with :func:`child_env` plus ``env``."""
        return subprocess.run(self.argv(*cmd), cwd=ROOT, env=child_env(**(env or {})), capture_output=True,
                              text=True, timeout=timeout)

    def launcher(self, *args: str, env: Mapping[str, str] | None = None,
                 timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return self.run(*launcher_cmd(*args), env=env, timeout=timeout)

    def admin_init(self, *uuids: str, policy: str = "") -> None:
        """``launcher admin init`` as the administrator runs it, then ``policy`` as the site policy file."""
        done = self.launcher("admin", "init", *(a for u in uuids for a in ("--uuid", u)))
        assert done.returncode == 0, done.stderr
        if policy:
            (self.binds[ETC] / "policy.toml").write_text(policy)

    def remove(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)
