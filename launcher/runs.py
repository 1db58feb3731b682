"""Runs on disk: ids, the results directory, the run record, and finding runs again.

A run's results directory (``<results root>/<run id>/``, layout in :mod:`worker.results`) is the one
place that outlives the processes and containers: ``status``, ``runs``, ``--resume`` and ``eval`` all
start from it. ``run.json`` is the launcher's own record (backend, state, pids or container ids).
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.errors import BadInput
from worker.contract import LOGS_DIR, SPEC_FILE, RunFiles, plain_env_id
from launcher.safefs import read_json_at
from worker.results import atomic_write_json

RUN_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{2,62}$")


def new_run_id(env_id: str, algo: str, now: float | None = None) -> str:
    """``<env>-<algo>-<YYYYmmdd-HHMMSS>-<4 hex>``: sortable by time, unique across users and hosts."""
    # ``pkg.module:EnvId`` is named after EnvId (flappybird-..., not flappybirdgymnas-...)
    env = re.sub(r"[^a-z0-9]+", "", plain_env_id(env_id).split("/")[-1].lower().split("-v")[0])[:16] or "env"
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return f"{env}-{algo}-{stamp}-{secrets.token_hex(2)}"


def new_secret() -> str:
    """A fresh run secret (256 bits, hex). It is never written to disk, logs or argv."""
    return secrets.token_hex(32)


@dataclass(frozen=True)
class RunDir:
    run_id: str
    path: Path

    @property
    def files(self) -> RunFiles:
        return RunFiles(self.path)

    @property
    def record(self) -> Path:
        return self.path / "run.json"

    def read_record(self) -> dict[str, Any]:
        return read_json_at(self.record) or {}

    def update_record(self, **changes: Any) -> dict[str, Any]:
        rec = self.read_record()
        rec.update(changes, updated=time.time())
        atomic_write_json(self.record, rec)
        return rec


def create_run_dir(root: Path, run_id: str) -> RunDir:
    """Make ``root/run_id`` (and ``logs/``). Raises BadInput if it exists or cannot be created."""
    path = root / run_id
    try:
        root.mkdir(parents=True, exist_ok=True)
        path.mkdir()
        (path / LOGS_DIR).mkdir()
    except FileExistsError:
        raise BadInput(f"results directory {path} already exists", hint="use --resume RUN to continue a run") from None
    except OSError as exc:
        raise BadInput(f"cannot create results directory {path}: {exc.strerror}",
                       hint="choose a writable --results root") from None
    return RunDir(run_id, path)


def find_run(root: Path, run: str) -> RunDir:
    """Find a run by id (or by path to its directory). Raises BadInput listing recent runs if absent."""
    candidate = Path(run)
    if candidate.is_dir() and (candidate / SPEC_FILE).exists():
        return RunDir(candidate.name, candidate.resolve())
    path = root / run
    if (path / SPEC_FILE).exists():
        return RunDir(run, path)
    known = [r.run_id for r in list_runs(root)][-5:]
    raise BadInput(f"no run {run!r} under {root}",
                   hint=("recent runs: " + ", ".join(known)) if known else f"no runs under {root} yet; check --results")


def list_runs(root: Path) -> list[RunDir]:
    """Every run directory under ``root``, oldest first."""
    if not root.is_dir():
        return []
    runs = [RunDir(p.name, p) for p in root.iterdir() if p.is_dir() and (p / SPEC_FILE).exists()]
    return sorted(runs, key=lambda r: (r.path / SPEC_FILE).stat().st_mtime)


def claim_live(run_dir: RunDir) -> int:
    """Take the run's liveness lease: a shared ``flock`` on the run directory itself, held by this launcher (and,
    once it starts, by the master: :func:`worker.contract.hold_live`) for as long as either lives.

    It is first taken exclusively, so it fails while any other launcher or master of the run holds it: a live
    run is never resumed beside itself (a second master on the same checkpoints and metrics, its record's
    pids overwritten). The directory, not a file in it: nothing is created, and a container that can write the
    directory cannot replace it. Returns the descriptor; the caller closes it when the run ends.

    Raises:
        BadInput: the run is live (exit 2; nothing was written), or its directory cannot be opened.
    """
    try:
        fd = os.open(run_dir.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise BadInput(f"cannot open run {run_dir.run_id}'s directory {run_dir.path}: {exc.strerror}",
                       hint="check the path and its permissions") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # not atomic: a rival that got in between wins, we refuse
    except OSError:
        os.close(fd)
        rec = run_dir.read_record()
        raise BadInput(f"run {run_dir.run_id} is still live: its launcher (pid {rec.get('launcher_pid', '?')}, state "
                       f"{rec.get('state', '?')}) or its master holds the liveness lease on {run_dir.path}; "
                       f"resuming it now would start a second master on the same checkpoints",
                       hint=f"wait for it to end, or stop it with `launcher down {run_dir.run_id}`, then resume"
                       ) from None
    return fd


def owner_uid_gid() -> tuple[int, int]:
    """The invoking user's uid:gid (``SUDO_UID`` when run under sudo), for files the run creates."""
    uid = int(os.environ.get("SUDO_UID", os.getuid()))
    gid = int(os.environ.get("SUDO_GID", os.getgid()))
    return uid, gid
