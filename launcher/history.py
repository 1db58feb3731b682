"""Run history: every run under a results root, as one row each, for ``launcher runs``.

A row comes from the run's files: ``run.json`` (the launcher's record: backend, state, pids), ``summary.json``
(the master's outcome), ``status.json`` (the master's live view, for a run still going) and the first line
of ``metrics.jsonl`` (when the run first started). A run whose record says it is live but whose processes
(or containers) are gone shows as ``stale``: its launcher was killed; ``launcher up --resume RUN`` continues it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from launcher.runs import RunDir, list_runs
from worker.results import read_json

LIVE_STATES = ("preparing", "starting", "running", "stopping")


@dataclass(frozen=True)
class RunRow:
    run_id: str
    env_id: str | None
    algo: str | None
    workers: int | None
    status: str  # the record's state, or stale / unknown
    recorded_state: str | None
    best_return: float | None
    last_return: float | None
    steps: int | None
    updates: int | None
    duration_s: float | None
    started: float | None  # Unix time of the first start
    backend: str | None
    exit_code: int | None
    outcome: str | None
    path: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _cmdline(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None


def _running(pid: int, must_contain: str | None = None) -> bool:
    """Whether ``pid`` is a live (not zombie) process whose command line contains ``must_contain``."""
    if pid <= 0:
        return False
    cmd = _cmdline(pid)
    if cmd is None or (must_contain is not None and must_contain not in cmd):
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def process_run_alive(run_id: str, record: dict[str, Any]) -> bool:
    """A process-backend run is alive while one of its children (their command lines name the run's spec,
    so the run id) or its launcher runs."""
    pids = [int(p) for p in (record.get("pids") or {}).values()]
    return any(_running(p, run_id) for p in pids) or _running(int(record.get("launcher_pid") or 0))


def docker_run_alive(run_id: str) -> bool | None:
    """Whether a container of ``run_id`` is running; None when no Docker engine answers."""
    try:
        from launcher import docker_client as dc
    except ImportError:
        return None
    if dc.engine_unavailable_reason() is not None:
        return None
    engine = dc.Engine()
    try:
        return any(c.status in ("running", "restarting", "created")
                   for c in engine.containers({dc.RUN_LABEL: run_id}))
    finally:
        engine.close()


def _first_start(run_dir: RunDir) -> float | None:
    try:
        with open(run_dir.files.metrics) as fh:
            first = fh.readline()
        t = json.loads(first).get("t")
        return float(t) if t is not None else None
    except (OSError, ValueError, AttributeError):
        try:
            return os.stat(run_dir.path).st_mtime
        except OSError:
            return None


def describe(run_dir: RunDir, *, docker_alive: Callable[[str], bool | None] = docker_run_alive,
             now: float | None = None) -> RunRow:
    """One run's row. ``docker_alive`` answers for Docker runs (injectable: tests have no engine)."""
    record = run_dir.read_record()
    summary = read_json(run_dir.files.summary) or {}
    status = read_json(run_dir.files.status) or {}
    spec = read_json(run_dir.files.spec) or {}
    recorded = record.get("state")
    state = str(recorded or "unknown")
    if state in LIVE_STATES:
        backend = record.get("backend")
        alive: bool | None = None  # unknown: keep the recorded state
        if backend == "process":
            alive = process_run_alive(run_dir.run_id, record)
        elif backend == "docker":
            alive = docker_alive(run_dir.run_id)
        if alive is False:
            ended_on_its_own = record.get("detached") and summary.get("outcome") in ("target_reached", "max_steps")
            state = "finished" if ended_on_its_own else "stale"
    started = _first_start(run_dir)
    final = state not in (*LIVE_STATES, "stale")  # ended, and the record says how
    last = summary if (final and summary) else status or summary
    if final:
        end = record.get("ended") or record.get("updated")
    elif state == "stale":  # it stopped when the master last wrote its status
        end = status.get("t") or record.get("updated")
    else:
        end = now or time.time()
    duration = None if started is None or end is None else max(0.0, float(end) - started)
    workers = record.get("workers") or summary.get("workers") or sum(g.get("workers", 0) for g in spec.get("groups", []))
    best = [v for v in (summary.get("best_mean_return"), status.get("best_mean_return")) if v is not None]
    return RunRow(
        run_id=run_dir.run_id, env_id=record.get("env_id") or spec.get("env_id"),
        algo=record.get("algo") or spec.get("algo"), workers=workers or None, status=state,
        recorded_state=recorded, best_return=max(best) if best else None, last_return=last.get("mean_return"),
        steps=last.get("env_steps"), updates=last.get("updates"),
        duration_s=None if duration is None else round(duration, 1), started=started,
        backend=record.get("backend"), exit_code=record.get("exit_code") if final else None,
        outcome=summary.get("outcome") if final else None, path=str(run_dir.path.resolve()))


def history(root: Path, **kwargs: Any) -> list[RunRow]:
    """Every run under ``root``, oldest first."""
    return [describe(rd, **kwargs) for rd in list_runs(root)]
