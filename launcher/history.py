"""Run history: every run under a results root, as one row each, for ``launcher runs``.

A row comes from the run's files: ``run.json`` (the launcher's record: backend, state, pids), ``summary.json``
(the master's outcome), ``status.json`` (the master's live view, for a run still going) and the first line
of ``metrics.jsonl`` (when the run first started). A run whose record says it is live but whose processes
(or containers) are gone ended as its summary says, or, with none, shows as ``stale``: its launcher was killed;
``launcher up --resume RUN`` continues it. The state is :func:`launcher.runstate.derive_state`'s, as in
``launcher status``.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from launcher import backends, lifecycle
from launcher.runs import RunDir, list_runs
from launcher import safefs
from launcher.rundata import integer, number, plain_doc, printable, status_doc, summary_doc, text
from launcher.safefs import read_json_at
from launcher.runstate import Seen, derive_state
from worker.contract import METRICS_FILE
from worker.ending import RunState


@dataclass(frozen=True)
class RunRow:
    run_id: str
    env_id: str | None
    algo: str | None
    workers: int | None
    status: str  # the run's state (worker.ending.RunState) as launcher.runstate.derive_state says
    recorded_state: str | None
    best_return: float | None
    last_return: float | None
    steps: int | None
    updates: int | None
    duration_s: float | None
    started: float | None  # Unix time of the first start
    backend: str | None
    exit_code: int | None
    outcome: str | None  # the master's (worker.ending.Outcome), once the run ended
    note: str  # what happened and what to do next, as `launcher status` says it
    error: str | None  # what ended a failed run: ``Type: message (in where)``
    path: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def observe(run_dir: RunDir, record: dict[str, Any]) -> Seen:
    """What the run's backend says of it now (:func:`launcher.lifecycle.observe`)."""
    found = backends.find(run_dir.run_id, run_dir, record)
    try:
        return lifecycle.observe(found)
    finally:
        found.close()


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


def describe(run_dir: RunDir, *, seen: Callable[[RunDir, dict[str, Any]], Seen] = observe,
             now: float | None = None) -> RunRow:
    """One run's row. ``seen`` says what its backend sees of a run whose record says live (injectable)."""
    record = run_dir.read_record()
    # All three are the run's to write (the spec: the launcher's record; a legacy run's own, for display only):
    # typed and printable first (launcher.rundata).
    summary = summary_doc(read_json_at(run_dir.files.summary))
    status = status_doc(read_json_at(run_dir.files.status))
    spec = plain_doc(run_dir.read_spec()[0])
    recorded = record.get("state")
    live_recorded = RunState.parse(recorded).live
    derived = derive_state(run_dir.run_id, record, summary, seen(run_dir, record) if live_recorded else Seen())
    state = derived.state
    started = _first_start(run_dir)
    final = not state.live and state != RunState.STALE  # ended, and the record or the summary says how
    last = summary if (final and summary) else status or summary
    if final:
        end = number(record.get("ended")) or number(record.get("updated"))
        if live_recorded:  # ended with nobody recording it (a detached run): when the master last wrote
            end = status.get("t") or end
    elif state == RunState.STALE:  # it stopped when the master last wrote its status
        end = status.get("t") or number(record.get("updated"))
    else:
        end = now or time.time()
    duration = None if started is None or end is None else max(0.0, float(end) - started)
    spec_groups = spec.get("groups")
    groups: list[Any] = spec_groups if isinstance(spec_groups, list) else []
    planned: int = sum(integer(g.get("workers")) or 0 for g in groups if isinstance(g, dict))
    workers = integer(record.get("workers")) or integer(summary.get("workers")) or planned
    best = [v for v in (summary.get("best_mean_return"), status.get("best_mean_return")) if v is not None]
    return RunRow(
        run_id=run_dir.run_id, env_id=text(record.get("env_id")) or text(spec.get("env_id")),
        algo=text(record.get("algo")) or text(spec.get("algo")), workers=workers or None, status=state.value,
        recorded_state=text(recorded), best_return=max(best) if best else None, last_return=last.get("mean_return"),
        steps=last.get("env_steps"), updates=last.get("updates"),
        duration_s=None if duration is None else round(duration, 1), started=started,
        backend=text(record.get("backend")), exit_code=integer(record.get("exit_code")) if state.terminal else None,
        outcome=None if derived.outcome is None else derived.outcome.value, note=derived.note,
        error=None if derived.error is None else printable(derived.error), path=str(run_dir.path.resolve()))


def history(root: Path, **kwargs: Any) -> list[RunRow]:
    """Every run under ``root``, oldest first."""
    return [describe(rd, **kwargs) for rd in list_runs(root)]
