"""The learner recovered in place, as the new master sees it (issue 27).

A master that dies by a signal (SIGKILL, the OOM killer, a crash) writes neither ``summary.json`` nor a final
``status.json``: its last ``status.json`` still says ``starting``, ``running`` or ``stopping``. When the
supervisor starts a new master of the same run (:mod:`launcher.recovery`), that master restores the newest
intact checkpoint as any master does, then reads the dead one's last status here and records the recovery:
when, from which checkpoint, and how many env steps the dead master had counted past it (the steps lost).
The record goes into ``status.json`` and ``summary.json`` (``recoveries``), ``metrics.jsonl`` (an event) and
TensorBoard (``recovery/*``). A master started by ``launcher up --resume`` after a killed run records the
same, which is what happened. A detached Docker run's master is restarted by the engine instead (its
``on-failure`` policy, :func:`launcher.backends.docker_specs.master_restart_max`): the same container, the same
``/results``, so the same ``status.json`` is read here.

That policy restarts any non-zero exit, a master that recorded its end (``summary.json``: it raised and exited 1)
included. Such a master must not train again: :func:`recorded_end` is what ``python -m worker master`` checks
first, and it exits 0 at once when the run already ended (the engine stops restarting it, ``summary.json`` and the
checkpoints stay as they were, and ``launcher status`` still reads the outcome). ``launcher up --resume`` deletes
``summary.json`` before its master starts, so a resumed run is not affected.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.checkpoint import Counters as CkptCounters

LIVE_MASTER_STATES = ("starting", "running", "stopping")  # a status.json left in one of these: its master died
MAX_KEPT = 50  # recoveries carried from master to master (status.json stays small)


def previous_master(status_path: Path) -> dict[str, Any] | None:
    """The ``status.json`` a master of this run left when it died mid-run, or None (no file, unreadable, or
    its master ended: ``finished`` / ``failed``)."""
    try:
        with open(status_path, "rb") as f:
            doc = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("state") not in LIVE_MASTER_STATES:
        return None
    return doc


def recorded_end(summary_path: Path, run_id: str) -> str | None:
    """The outcome run ``run_id``'s ``summary.json`` records (a master of this run ended it), or None: no file,
    unreadable, another run's, or no outcome named. A master that starts with one is a restart after the end."""
    from worker.ending import Outcome

    try:
        with open(summary_path, "rb") as f:
            doc = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("run_id", run_id) != run_id:
        return None
    outcome = Outcome.parse(doc.get("outcome"))
    return outcome.value if outcome is not None else None


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def earlier_recoveries(prev: dict[str, Any]) -> list[dict[str, Any]]:
    """The recoveries the dead master carried (well-formed entries only)."""
    kept = prev.get("recoveries")
    return [r for r in kept if isinstance(r, dict)][-MAX_KEPT:] if isinstance(kept, list) else []


def recovery_entry(prev: dict[str, Any], restored: "CkptCounters | None", checkpoint: str | None) -> dict[str, Any]:
    """One recovery: the dead master's last counters against what the new one restored."""
    before = _count(prev.get("env_steps"))
    steps = restored.env_steps if restored is not None else 0
    return {"at": round(time.time(), 3), "dead_pid": _count(prev.get("pid")) or None,
            "checkpoint": os.path.basename(checkpoint) if checkpoint else None,
            "restored_env_steps": steps, "restored_updates": restored.updates if restored is not None else 0,
            "last_reported_env_steps": before, "steps_lost": max(0, before - steps)}


def note_recovery(prev: dict[str, Any] | None, tally: Any, restored_from: str | None, metrics: Any, tb: Any) -> None:
    """Record on the new master that it replaced a dead one (``prev``: what :func:`previous_master` read before
    this master wrote its first status; None: nothing to record). ``tally``'s counters are the restored ones."""
    if prev is None:
        return
    entry = recovery_entry(prev, tally.c if restored_from else None, restored_from)
    tally.recoveries = [*earlier_recoveries(prev), entry][-MAX_KEPT:]
    metrics.write({"type": "event", "t": entry["at"], "event": "master_recovered", **entry})
    tb.write(tally.c.env_steps, {"recovery/count": len(tally.recoveries), "recovery/steps_lost": entry["steps_lost"]})
