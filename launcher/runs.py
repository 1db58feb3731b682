"""Runs on disk: ids, the results directory, the launcher's own records of a run, and finding runs again.

A run has two directories side by side under the results root:

* ``<root>/<run id>/``, its results (layout in :mod:`worker.results`): the run's data directory, the one
  thing its containers get (``/results``, read-write). Nothing the host decides with is read from it.
* ``<root>/.launcher/<run id>/``, the launcher's records (:data:`HOST_DIR`): ``config.json``, ``plan.json``,
  ``spec.json`` and ``run.json`` (backend, state, pids and their start times, container ids). Never mounted
  into a container, so what ``--resume``, ``eval``, ``status``, ``logs`` and ``down`` act on is what the
  launcher wrote. All four are also copied into the results for the user's own tools (and the process
  backend's ``--spec``); the host never reads those copies back.

A run made before the records moved (a *legacy* run: ``spec.json`` only in its results) is still listed
and shown; ``--resume`` and ``eval`` take from it only what cannot name code or a place (see
:func:`launcher.up.resume_config`, :func:`launcher.eval_env.run_spec`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.errors import BadInput
from worker.contract import CONFIG_FILE, LOGS_DIR, PLAN_FILE, SPEC_FILE, RunFiles, plain_env_id
from launcher.safefs import distrust, read_json_at
from worker.results import atomic_write_json

log = logging.getLogger(__name__)

RUN_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{2,62}$")
HOST_DIR = ".launcher"  # <root>/.launcher/<run id>/: the launcher's records of a run, never mounted anywhere
RECORD_FILE = "run.json"


def new_run_id(env_id: str, algo: str, now: float | None = None) -> str:
    """``<env>-<algo>-<YYYYmmdd-HHMMSS>-<4 hex>``: sortable by time, unique across users and hosts; ``<algo>`` is a
    built-in's name or the class of the user's algorithm, lower case."""
    # ``pkg.module:EnvId`` is named after EnvId (flappybird-..., not flappybirdgymnas-...)
    env = re.sub(r"[^a-z0-9]+", "", plain_env_id(env_id).split("/")[-1].lower().split("-v")[0])[:16] or "env"
    # A user's algorithm (``dir/file.py:MyAlgo``, ``pkg.mod:MyAlgo``) is named after its class.
    name = re.sub(r"[^a-z0-9]+", "", algo.rpartition(":")[2].lower())[:16] or "algo"
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return f"{env}-{name}-{stamp}-{secrets.token_hex(2)}"


def new_secret() -> str:
    """A fresh run secret (256 bits, hex). It is never written to disk, logs or argv."""
    return secrets.token_hex(32)


@dataclass(frozen=True)
class RunDir:
    """A run on disk: ``path`` its results (the containers' data directory), :attr:`host` the launcher's
    records of it."""

    run_id: str
    path: Path

    @property
    def files(self) -> RunFiles:
        """The results' files (the run writes them: read through :mod:`launcher.safefs`, decide nothing on
        them)."""
        return RunFiles(self.path)

    @property
    def host(self) -> Path:
        """The launcher's records of the run, beside the results and never mounted into a container."""
        return self.path.parent / HOST_DIR / self.path.name

    @property
    def legacy(self) -> bool:
        """A run made before the records moved out of its results: no record in :attr:`host`."""
        return not (self.host / RECORD_FILE).exists() and not (self.host / SPEC_FILE).exists()

    @property
    def record(self) -> Path:
        """``run.json``: in :attr:`host`; a legacy run's in its results (shown, never acted on alone)."""
        return self.path / RECORD_FILE if self.legacy else self.host / RECORD_FILE

    @property
    def config(self) -> Path:
        return self.host / CONFIG_FILE

    @property
    def spec(self) -> Path:
        return self.host / SPEC_FILE

    @property
    def plan(self) -> Path:
        return self.host / PLAN_FILE

    def read_record(self) -> dict[str, Any]:
        return read_json_at(self.record) or {}

    def update_record(self, **changes: Any) -> dict[str, Any]:
        """Apply ``changes`` to the record (:attr:`record`), then copy it into the results for the user's tools
        (a copy the host never reads; a container that put a directory in its way only loses the copy)."""
        rec = self.read_record()
        rec.update(changes, updated=time.time())
        atomic_write_json(self.record, rec)
        if not self.legacy:
            copy_to_results(self.path / RECORD_FILE, rec)
        return rec

    def read_spec(self) -> tuple[dict[str, Any], bool]:
        """The run's spec and whether it came from the launcher's records (True) or, for a legacy run, from its
        results, which the run's containers could write (False: take nothing from it that names code)."""
        spec = read_json_at(self.spec)
        if spec is not None or not self.legacy:
            return spec or {}, True
        return read_json_at(self.files.spec) or {}, False

    def make_host(self) -> None:
        """Make :attr:`host` (and ``<root>/.launcher``) if missing, owned by the invoking user.

        Raises:
            BadInput: either cannot be made, is a link, is writable by every user without the sticky bit, or is
                owned by another user than the invoking one or root (a record there could be anyone's; exit 2).
        """
        top = self.host.parent
        uid, gid = owner_uid_gid()
        for d in (top, self.host):
            try:
                d.mkdir(mode=0o755)
                if os.geteuid() == 0 and uid != 0:  # under sudo: the user's own, for a later `launcher down`
                    os.chown(d, uid, gid)
            except FileExistsError:
                pass
            except OSError as exc:
                raise BadInput(f"cannot create the run's records directory {d}: {exc.strerror}",
                               hint="choose a writable --results root") from None
            # Only this user or root may own either (the owner of a sticky directory can still rename what is in
            # it), and checked before anything is made inside: a link is refused, never followed.
            why = distrust(d, uid)
            if why is not None:
                raise BadInput(f"the run's records directory {d} {why}; the launcher keeps nothing there",
                               hint=f"on a results root shared by several users, have root create {top} with mode "
                                    f"1777 (`sudo install -d -m 1777 {top}`); else remove {d} or choose another "
                                    f"--results root")


def copy_to_results(path: Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` at ``path`` in a run's results as a copy for the user's tools; a failure is logged, not
    raised (the results are the run's to write: what is there may be in the way)."""
    try:
        atomic_write_json(path, doc)
    except OSError as exc:
        log.warning("could not copy %s into the results (%s); the launcher's record is kept apart", path.name, exc)


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
    rd = RunDir(run_id, path)
    top_was_there = rd.host.parent.exists()

    def undo(host_is_ours: bool) -> None:  # nothing of the refused run is left behind
        if host_is_ours:  # (a refused one may be planted: never touched)
            shutil.rmtree(rd.host, ignore_errors=True)
        shutil.rmtree(path, ignore_errors=True)
        if not top_was_there:
            try:
                rd.host.parent.rmdir()  # only if empty: another launcher may have made its run's records since
            except OSError:
                pass

    try:
        rd.make_host()
    except BadInput:
        undo(False)
        raise
    try:
        atomic_write_json(rd.host / RECORD_FILE, {"run_id": run_id, "created": time.time()})
    except OSError as exc:  # a full or failing file system: say so
        undo(True)
        raise BadInput(f"cannot write the run's record in {rd.host}: {exc.strerror or exc}",
                       hint="free space on that file system, or choose another --results root") from None
    return rd


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` is a run's results directory (its records, or a legacy run's spec in it)."""
    return (path.parent / HOST_DIR / path.name / SPEC_FILE).exists() or (path / SPEC_FILE).exists()


def find_run(root: Path, run: str) -> RunDir:
    """Find a run by id (or by path to its directory). Raises BadInput listing recent runs if absent."""
    candidate = Path(run)
    if candidate.is_dir() and is_run_dir(candidate.resolve()):
        return RunDir(candidate.resolve().name, candidate.resolve())
    path = root / run
    if not run.startswith(".") and "/" not in run and path.is_dir() and is_run_dir(path):
        return RunDir(run, path)
    known = [r.run_id for r in list_runs(root)][-5:]
    raise BadInput(f"no run {run!r} under {root}",
                   hint=("recent runs: " + ", ".join(known)) if known else f"no runs under {root} yet; check --results")


def list_runs(root: Path) -> list[RunDir]:
    """Every run directory under ``root``, oldest first."""
    if not root.is_dir():
        return []
    runs = [RunDir(p.name, p) for p in root.iterdir() if not p.name.startswith(".") and p.is_dir() and is_run_dir(p)]
    return sorted(runs, key=lambda r: _mtime(r.spec) or _mtime(r.files.spec) or 0.0)


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


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


def error_line(error: Any) -> str | None:
    """``Type: message (where)`` of a failed run's ``summary.json`` error, printable characters only (the file
    is the run's to write), or None."""
    if not isinstance(error, dict):
        return None
    parts = [error.get("type"), error.get("message"), error.get("where")]
    texts = [p for p in parts if isinstance(p, str)]
    if len(texts) != len(parts):
        return None
    clean = ["".join(c if c.isprintable() else "?" for c in p)[:400] for p in texts]
    return f"{clean[0]}: {clean[1]} (in {clean[2]})"
