"""Runs after ``up``: what is running (``status``), what it printed (``logs``), and stopping it (``down``).

A run is found from two places that outlive any launcher process: its results directory (``run.json`` names
the backend and the launcher's pid) and the backend's own system (the Docker engine labels every container,
network and service with ``launcher.run`` and friends). The backend named in the record gives the run back as
a :class:`~launcher.backends.base.FoundRun` (its parts, their logs, a ``down``); nothing here depends on which
backend it is. ``down`` therefore works after the launcher was killed, and on a run whose results root
nobody remembers.

Library functions only; :mod:`launcher.cli.status`, ``logs`` and ``down`` print what these return.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from launcher import backends
from launcher.backends.base import DownReport, FoundRun, Part, PartState, name_order
from launcher.errors import BadInput
from launcher.procs import belongs, holds_flock, send_signal, wait_gone
from launcher.runs import RunDir, error_line, find_run, list_runs, owner_uid_gid
from launcher import safefs
from launcher.rundata import status_doc, summary_doc
from launcher.safefs import read_json_at
from launcher.runstate import Seen, derive_state
from worker.contract import LOGS_DIR
from worker.ending import Outcome, RunState, last_fatal

log = logging.getLogger(__name__)

__all__ = ["DownReport", "RunView", "down_all", "down_run", "follow_logs", "log_files", "log_target_name",
           "observe", "read_logs", "view_run", "view_runs"]


@dataclass
class RunView:
    """A run as ``launcher status`` shows it."""

    run_id: str
    path: Path | None
    backend: str
    state: RunState  # as launcher.runstate.derive_state says
    parts: list[Part] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)  # the master's status.json
    summary: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    gpu_watch: dict[str, Any] = field(default_factory=dict)  # run.json's: foreign processes on its GPUs
    outcome: Outcome | None = None  # the master's, once the run ended
    part_errors: dict[str, str] = field(default_factory=dict)  # what a part that stopped raised last, by name
    elastic: dict[str, Any] = field(default_factory=dict)  # run.json's: an elastic run's groups and yields
    gpus_from: list[Any] = field(default_factory=list)  # run.json's: the elastic runs that gave this one its GPUs

    @property
    def live(self) -> bool:
        return any(p.state.alive for p in self.parts)

    def to_dict(self) -> dict[str, Any]:
        s = self.status
        groups = s.get("groups") or {}
        return {
            "schema": "launcher.run-status/v2", "run_id": self.run_id, "results": str(self.path or ""),
            "backend": self.backend, "state": self.state.value, "live": self.live, "note": self.note,
            "parts": [{**p.to_dict(), **({"error": self.part_errors[p.name]} if p.name in self.part_errors else {})}
                      for p in self.parts],
            "env_steps": s.get("env_steps", self.summary.get("env_steps")),
            "env_steps_per_s": s.get("env_steps_per_s"), "updates": s.get("updates", self.summary.get("updates")),
            "mean_return": s.get("mean_return", self.summary.get("mean_return")),
            "episodes_in_window": s.get("episodes_in_window"),
            "groups_connected": sum(1 for g in groups.values() if g.get("connected")), "groups": len(groups),
            "workers_connected": sum(g.get("workers", 0) for g in groups.values() if g.get("connected")),
            "outcome": None if self.outcome is None else self.outcome.value,
            # What ended a failed run (summary.json's error: type, message, where), printable text only.
            "error": error_line(self.summary.get("error")),
            "foreign_processes": self.gpu_watch.get("foreign_processes", []),
            # Masters that died by a signal and were replaced in place (issue 27), as the newest master says.
            "recoveries": s.get("recoveries", self.summary.get("recoveries")) or [],
            # An elastic run (launcher.elastic): its minimum, each group's state, the yields and regrowths.
            "elastic": self.elastic or None,
            "gpus_from": self.gpus_from,
        }


@contextmanager
def opened(root: Path, run: str) -> Iterator[FoundRun]:
    """Run ``run`` (an id or a directory) under ``root``, or known only by its labels, found through its
    backend; closed on exit.

    Raises:
        BadInput: no such run under ``root`` and no backend knows it by label.
    """
    try:
        rd = find_run(root, run)
    except BadInput:
        found = backends.find_by_label(run)
        if found is None:
            raise
    else:
        found = backends.find(rd.run_id, rd, rd.read_record())
    try:
        yield found
    finally:
        found.close()


def observe(found: FoundRun, parts: list[Part] | None = None) -> Seen:
    """What the run's backend system and this host's process table say of ``found`` now (``parts``: its parts,
    when the caller asked for them already)."""
    if parts is None:
        parts = found.parts()
    if found.unreachable:
        return Seen(unreachable=f"cannot ask {found.system}: {found.unreachable}")
    master = next((p for p in parts if p.name == "master"), None)
    record = found.record
    start = record.get("launcher_start")
    launcher_alive = belongs(int(record.get("launcher_pid") or 0), "launcher",
                             start=start if isinstance(start, int) else None, owner_uid=None, leader=False)
    return Seen(parts_alive=any(p.state.alive for p in parts), launcher_alive=launcher_alive,
                master_exit=master.exit_code if master is not None and not master.state.alive else None)


def _as_yielded(part: Part, elastic: dict[str, Any]) -> Part:
    """A group an elastic run gave up for a queued run (run.json's ``elastic``) is shown yielded, not exited."""
    groups: dict[str, Any] = elastic["groups"] if isinstance(elastic.get("groups"), dict) else {}
    if part.group is not None and not part.state.alive and groups.get(str(part.group)) == "yielded":
        return replace(part, state=PartState.YIELDED, status="yielded")
    return part


def view_run(found: FoundRun) -> RunView:
    """What a found run is doing now: its record, the master's status and the backend's parts, its state as
    :func:`launcher.runstate.derive_state` says."""
    rd, record = found.run_dir, found.record
    backend = str(record.get("backend", found.backend))
    view = RunView(found.run_id, rd.path if rd else None, backend, RunState.UNKNOWN,
                   gpu_watch=record.get("gpu_watch") or {})
    if isinstance(record.get("elastic"), dict):
        view.elastic = record["elastic"]
    if isinstance(record.get("gpus_from"), list):
        view.gpus_from = [n for n in record["gpus_from"] if isinstance(n, dict)]
    if rd is not None:
        # Written by the run's containers: typed and printable before anything is shown (launcher.rundata).
        view.status = status_doc(read_json_at(rd.files.status))
        view.summary = summary_doc(read_json_at(rd.files.summary))
    view.parts = [_as_yielded(p, view.elastic) for p in found.parts()]
    derived = derive_state(found.run_id, record, view.summary, observe(found, view.parts))
    view.state, view.outcome, view.note = derived.state, derived.outcome, derived.note
    if not found.unreachable:
        view.part_errors = part_errors(found, view.parts)
    return view


FATAL_TAIL_BYTES = 64 * 1024  # a part's fatal line is its last: this much of the end of its log is read


def part_errors(found: FoundRun, parts: list[Part]) -> dict[str, str]:
    """What each part that stopped other than cleanly raised last, as ``Type: message (in where)``, by part
    name: the fatal line it wrote last in its log (:func:`worker.ending.fatal_line`), from the backend while the
    part exists, else the kept ``logs/`` file. A group has no results directory: this is how its root cause
    reaches ``launcher status``."""
    out = {}
    for p in parts:
        if p.state.alive or p.exit_code == 0:
            continue
        data = found.logs(p.name)
        if data is None and found.run_dir is not None:
            try:
                data = safefs.read_tail(found.run_dir.path, f"{LOGS_DIR}/{p.name}.log", max_bytes=FATAL_TAIL_BYTES)
            except OSError:  # no log kept, or not a file to trust (safefs.UnsafeFile)
                data = None
        error = error_line(last_fatal(data[-FATAL_TAIL_BYTES:].decode(errors="replace"))) if data else None
        if error:
            out[p.name] = error
    return out


def view_runs(root: Path, *, run: str | None = None) -> list[RunView]:
    """``run`` (an id or directory), or every run under ``root`` plus any run the engine knows by label
    with its results elsewhere."""
    if run is not None:
        with opened(root, run) as found:
            return [view_run(found)]
    views = []
    for rd in list_runs(root):
        found = backends.find(rd.run_id, rd, rd.read_record())
        try:
            views.append(view_run(found))
        finally:
            found.close()
    known = {v.run_id for v in views}
    for rid in sorted(backends.live_run_ids(root, user=None) - known):
        label_found = backends.find_by_label(rid)
        if label_found is not None:
            try:
                views.append(view_run(label_found))
            finally:
                label_found.close()
    return views


# ------------------------------------------------------------------------------------------------ down
def _stop_launcher(record: dict[str, Any], grace_s: float, run_dir: RunDir | None) -> bool:
    """SIGTERM an attached launcher still supervising the run: it tears down in order and records the end.
    Only a process that holds the run's liveness lease (a lock on the run directory) is its launcher: a pid in
    ``run.json`` alone proves nothing (anyone who can write the directory can write it)."""
    pid = int(record.get("launcher_pid") or 0)
    start = record.get("launcher_start")
    if pid == os.getpid() or run_dir is None or not belongs(
            pid, "launcher", start=start if isinstance(start, int) else None, owner_uid=None, leader=False):
        return False
    if not holds_flock(pid, run_dir.path):
        log.warning("pid %d is named as run %s's launcher but does not hold its lease on %s; not signalled", pid,
                    run_dir.run_id, run_dir.path)
        return False
    send_signal(pid, signal.SIGTERM, group=False)
    wait_gone([(pid, "launcher")], grace_s + 6.0)
    return True


def down_run(root: Path, run: str, *, grace_s: float = 8.0) -> DownReport:
    """Stop run ``run`` (id or directory) and remove what it made; results stay.

    Order: an attached launcher still watching it gets SIGTERM first (it stops the master, which
    checkpoints, then the groups); then the run's backend stops whatever is left the same way, master first.
    Idempotent.

    Raises:
        BadInput: no such run under ``root`` and nothing labelled with it.
        LauncherError: the backend's system (the Docker engine) cannot be reached.
    """
    with opened(root, run) as found:
        rd = found.run_dir
        report = DownReport(found.run_id, str(rd.path) if rd else "")
        report.launcher_signalled = _stop_launcher(found.record, grace_s, rd)
        found.down(report, grace_s=grace_s)
        if found.backend not in backends.LABEL_BACKENDS:
            # Containers are found by the engine's labels whatever the record says: a legacy record sat in the
            # results, where the run's own master could rewrite its backend to hide from `down`.
            labelled = backends.labelled(found.run_id, rd)
            if labelled is not None:
                try:
                    labelled.down(report, grace_s=grace_s)
                finally:
                    labelled.close()
        if rd is not None and report.removed_anything and not report.launcher_signalled:
            if RunState.parse(found.record.get("state")).live:
                rd.update_record(state=RunState.INTERRUPTED.value, message="stopped by `launcher down`", ended=time.time())
        return report


def down_all(root: Path, *, grace_s: float = 8.0) -> list[DownReport]:
    """``down`` every live run: process runs under ``root`` with live pids, and every run the engine knows by
    label (only the invoking user's unless the launcher runs as root)."""
    mine = None if os.geteuid() == 0 else str(owner_uid_gid()[0])
    return [down_run(root, rid, grace_s=grace_s) for rid in sorted(backends.live_run_ids(root, user=mine))]


# ------------------------------------------------------------------------------------------------ logs
def log_target_name(master: bool, group: int | None) -> str | None:
    """``master``, ``group-N``, or None (every part)."""
    if group is not None:
        return f"group-{group}"
    return "master" if master else None


def log_files(rd: RunDir) -> dict[str, Path]:
    """The run's kept log files by part name (``master``, ``group-0``, ...)."""
    d = rd.files.logs
    if d.is_symlink() or not d.is_dir():  # a link planted by a container is not followed (launcher.safefs)
        return {}
    files = {p.stem: p for p in d.glob("*.log")}
    return dict(sorted(files.items(), key=lambda kv: name_order(kv[0])))


def read_logs(root: Path, run: str, part: str | None) -> Iterator[tuple[str, bytes]]:
    """(part name, output) of ``part`` (None: every part), from the backend while the run's parts exist, else
    from the files kept in ``<results>/<run>/logs/``: a part that ended while the run goes on (a Slurm step that
    finished, so Slurm no longer lists it, while the master writes its model) is read from its kept file.

    Raises:
        BadInput: no such run, or no such part.
    """
    with opened(root, run) as found:
        names = [p.name for p in found.parts()]
        if names and (part is None or part in names):
            live = {n: found.logs(n) for n in ([part] if part else names)}
            if all(data is not None for data in live.values()):
                yield from ((n, data or b"") for n, data in live.items())
                return
        if found.run_dir is None:
            if names:
                _check_part(part, names, found.run_id)
            raise BadInput(f"run {run} has neither containers nor a results directory here")
        files = log_files(found.run_dir)
        _check_part(part, known_parts(names, files), found.run_id)
        for name in ([part] if part else list(files)):
            if name not in files:  # a live part whose log is not kept (yet)
                yield name, b""
                continue
            try:
                yield name, safefs.read_tail(found.run_dir.path, f"{LOGS_DIR}/{files[name].name}")
            except FileNotFoundError:
                yield name, b""


def follow_logs(root: Path, run: str, part: str | None, *, poll_s: float = 0.5) -> Iterator[bytes]:
    """Output of ``part`` (None: the master) as it is written, until the run stops (like ``tail -f``)."""
    part = part or "master"
    with opened(root, run) as found:
        names = [p.name for p in found.parts()]
        if part in names:
            stream = found.follow(part, poll_s=poll_s)
            if stream is not None:
                yield from stream
                return
        if found.run_dir is None:
            if names:
                _check_part(part, names, found.run_id)
            raise BadInput(f"run {run} has neither containers nor a results directory here")
        files = log_files(found.run_dir)
        _check_part(part, list(files), found.run_id)  # followed from its file: it must have one
        with safefs.open_read(found.run_dir.path, f"{LOGS_DIR}/{files[part].name}") as fh:
            while True:
                chunk = fh.read(1 << 20)
                if chunk:
                    yield chunk
                    continue
                if not any(p.state.alive for p in found.parts()):
                    return
                time.sleep(poll_s)


def known_parts(live: list[str], files: Mapping[str, Path]) -> list[str]:
    """The parts of a run one can ask for: those the backend lists and those whose log is kept, in part order."""
    return sorted(set(live) | set(files), key=name_order)


def _check_part(part: str | None, known: list[str], run_id: str) -> None:
    if part is not None and part not in known:
        raise BadInput(f"run {run_id} has no {part} (it has: {', '.join(known) or 'nothing yet'})",
                       hint="pick one with --master or --group N")
