"""What state a run is in: one pure function over its record, its outcome and what its backend sees now.

``launcher status``, ``launcher runs``, their ``--json`` and the supervisor all ask :func:`derive_state`, so a
run reads the same everywhere. The vocabulary (:class:`~worker.ending.RunState`,
:class:`~worker.ending.Outcome`) is the contract's; what the backend's system (the Docker engine, the process
table) says is gathered by the caller into a :class:`Seen`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from launcher.runs import error_line
from worker.ending import Outcome, RunState


@dataclass(frozen=True)
class Seen:
    """What the backend's system says of a run now.

    Attributes:
        unreachable: why the system cannot be asked (the engine is down), ``""`` when it answered; then nothing
            else here is known and the record is taken as it is.
        parts_alive: a part of the run (the master, a group) is starting, running or being restarted.
        launcher_alive: the run's launcher still runs (it may be preparing: building, planning, queueing).
        master_exit: the master's exit status when it exited and its system still knows it (Docker keeps
            exited containers), None while it runs or when unknown (a process run's gone master).
    """

    unreachable: str = ""
    parts_alive: bool = False
    launcher_alive: bool = False
    master_exit: int | None = None


@dataclass(frozen=True)
class Derived:
    """A run's state as every command shows it, its outcome (None while live or never written), and a note
    for the user (what happened, what to do next), ``""`` when there is nothing to add."""

    state: RunState
    outcome: Outcome | None
    note: str = ""
    error: str | None = None  # summary.json's error as one line: ``Type: message (in where)``


def end_state(outcome: Outcome | None, master_exit: int | None) -> RunState:
    """How a run ended once its master did: from the master's ``outcome`` (``summary.json``) and its exit status
    (None when unknown: a process run's gone master). STALE when neither says (nothing was recorded)."""
    if master_exit:  # whatever the summary says: it may be an older incarnation's
        return RunState.FAILED
    if outcome is None:  # a master that exits 0 has written its summary: here it is missing or unreadable
        return RunState.STALE if master_exit is None else RunState.FAILED
    if outcome.finished:
        return RunState.FINISHED
    return RunState.FAILED if outcome == Outcome.FAILED else RunState.INTERRUPTED


def derive_state(run_id: str, record: Mapping[str, Any], summary: Mapping[str, Any], seen: Seen) -> Derived:
    """The state of run ``run_id`` from its ``run.json`` (``record``), its ``summary.json`` and ``seen``.

    A record that says the run ended is believed (the supervisor writes it last). A record that says live is
    checked against ``seen``: a master that exited non-zero failed the run (whatever its groups still do); a run
    of which nothing runs finished or failed as its master's outcome says (a detached run ends this way), or, when
    the master was stopped or left no outcome, is STALE: its launcher was killed before it recorded the end, and
    ``launcher up --resume`` continues it.
    """
    recorded = RunState.parse(record.get("state"))
    outcome = Outcome.parse(summary.get("outcome"))
    error = error_line(summary.get("error"))
    if not recorded.live:
        return Derived(recorded, outcome if recorded.terminal else None, "", error)
    if seen.unreachable:
        return Derived(recorded, None, seen.unreachable)
    if not seen.master_exit and (seen.parts_alive or seen.launcher_alive):
        return Derived(recorded, None)
    state = end_state(outcome, seen.master_exit)
    resume = f"`launcher down {run_id}` then `launcher up --resume {run_id}` continues from the last checkpoint"
    if state in (RunState.STALE, RunState.INTERRUPTED):
        # A stopped master (its launcher's death stops it too) with nobody to record the end: resumable as it is.
        said = "" if outcome is None else f" (the master's own outcome: {outcome.value})"
        why = "stopped outside the launcher?" if record.get("detached") else "the launcher was killed?"
        return Derived(RunState.STALE, outcome, f"run.json says {recorded.value!r} but nothing of it is running and "
                                                f"nothing recorded its end{said} ({why}); "
                                                f"`launcher up --resume {run_id}` continues from the last checkpoint")
    outcome = outcome or (Outcome.FAILED if state == RunState.FAILED else None)
    if state == RunState.FINISHED:
        note = f"the run ended on its own; `launcher down {run_id}` removes what is left of it" \
            if record.get("detached") else ""
    elif seen.master_exit:  # groups may still be retrying (and restarting) while nobody serves them
        note = f"the master exited with code {seen.master_exit}" + (f"; it raised {error}" if error else "") + \
            f"; {resume}"
    else:
        note = f"the run failed: {error or 'the master left no summary.json here; its log says why'}; {resume}"
    return Derived(state, outcome, note, error)
