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

from launcher import backends
from launcher.procs import running
from launcher.runs import RunDir, list_runs
from launcher import safefs
from launcher.safefs import read_json_at
from worker.contract import METRICS_FILE

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


def run_alive(run_dir: RunDir, record: dict[str, Any]) -> bool | None:
    """Whether any part of the run still runs, or its launcher; None when its backend cannot be asked (no
    Docker engine answers)."""
    found = backends.find(run_dir.run_id, run_dir, record)
    try:
        parts = found.parts()
        if found.unreachable:
            return None
    finally:
        found.close()
    return any(p.state.alive for p in parts) or running(int(record.get("launcher_pid") or 0), "launcher")


def _first_start(run_dir: RunDir) -> float | None:
    try:
        with safefs.open_read(run_dir.path, METRICS_FILE) as fh:
            first = fh.readline(65536).decode()
        t = json.loads(first).get("t")
        return float(t) if t is not None else None
    except (OSError, ValueError, AttributeError):
        try:
            return os.stat(run_dir.path).st_mtime
        except OSError:
            return None


def describe(run_dir: RunDir, *, alive: Callable[[RunDir, dict[str, Any]], bool | None] = run_alive,
             now: float | None = None) -> RunRow:
    """One run's row. ``alive`` says whether a live-looking run still runs (injectable)."""
    record = run_dir.read_record()
    summary = read_json_at(run_dir.files.summary) or {}
    status = read_json_at(run_dir.files.status) or {}
    spec = read_json_at(run_dir.files.spec) or {}
    recorded = record.get("state")
    state = str(recorded or "unknown")
    if state in LIVE_STATES:
        still = alive(run_dir, record)
        if still is False:
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
