"""How a run ends, in words both halves share: part of the launcher↔worker contract, beside
:mod:`worker.contract` (which holds the exit codes of ``python -m worker master|group``).

The run's states (:class:`RunState`, with ``live`` and ``terminal``); the master's outcomes (:class:`Outcome`, ``summary.json``'s ``outcome``); and the error document
(:func:`error_doc`: type, message, where) that ``summary.json`` carries and a process that dies of an exception
writes last on stderr (:func:`fatal_line`). Standard library only, like :mod:`worker.contract`.
"""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Any


def error_doc(exc: BaseException, where: str) -> dict[str, str]:
    """What ``summary.json`` (and a group's BYE) says of the exception that ended a run or a group: its type,
    its message and where (``where``, a phase such as ``the learner's update``, plus the innermost frame's
    ``file:line in function``). The launcher shows it as one line (:func:`launcher.runs.error_line`)."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    at = f"{Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    return {"type": type(exc).__name__, "message": str(exc)[:2000], "where": where + (f" ({at})" if at else "")}


FATAL_MARK = "launcher-fatal: "  # starts the line a run's process writes last on stderr (its log) when it dies


def fatal_line(doc: dict[str, str]) -> str:
    """The one line a process that dies of an exception writes last on stderr: :func:`error_doc` as JSON after
    :data:`FATAL_MARK`. A group has no results directory to write to (a container of it mounts none): the
    launcher finds the root cause in the group's log (:func:`last_fatal`), as PyTorch elastic's agent reads a
    failing worker's error file."""
    return FATAL_MARK + json.dumps(doc, sort_keys=True)


def last_fatal(log_text: str) -> dict[str, str] | None:
    """The last :func:`fatal_line` in ``log_text`` (a process's output), or None. The log is the process's to
    write: a malformed line reads as none."""
    for line in reversed(log_text.splitlines()):
        head, mark, rest = line.partition(FATAL_MARK)
        if not mark:
            continue
        try:
            doc = json.loads(rest)
        except ValueError:
            return None
        if isinstance(doc, dict) and all(isinstance(doc.get(k), str) for k in ("type", "message", "where")):
            return {k: doc[k] for k in ("type", "message", "where")}
        return None
    return None


class RunState(str, enum.Enum):
    """Where a run is, in ``run.json``, ``launcher status``, ``launcher runs`` and every ``--json``.

    The launcher's supervisor records PREPARING -> STARTING (QUEUED while a scheduler holds it back) -> RUNNING
    -> STOPPING -> FINISHED | FAILED | TIMED_OUT | INTERRUPTED. STALE is never recorded: it is what a run is
    whose record says live while nothing of it runs and no outcome was written (its launcher was killed).
    """

    PREPARING = "preparing"
    QUEUED = "queued"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    FINISHED = "finished"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    INTERRUPTED = "interrupted"
    STALE = "stale"
    UNKNOWN = "unknown"

    def __str__(self) -> str:  # the word, in f-strings too (a str-mixin Enum prints its name on 3.11)
        return str(self.value)

    @property
    def live(self) -> bool:
        """Something of the run is (or should be) running."""
        return self in _LIVE

    @property
    def terminal(self) -> bool:
        """The run ended and its record says how; it changes only by ``launcher up --resume``."""
        return self in _TERMINAL

    @classmethod
    def parse(cls, value: Any) -> "RunState":
        """The state a record names; UNKNOWN for anything else (a record is the run's to write). Older
        launchers' derived words still read: ``ended`` was a detached run that finished."""
        if value == "ended":
            return cls.FINISHED
        try:
            return cls(value)
        except ValueError:
            return cls.UNKNOWN


_LIVE = frozenset({RunState.PREPARING, RunState.QUEUED, RunState.STARTING, RunState.RUNNING, RunState.STOPPING})
_TERMINAL = frozenset({RunState.FINISHED, RunState.FAILED, RunState.TIMED_OUT, RunState.INTERRUPTED})


class Outcome(str, enum.Enum):
    """How the master ended a run: ``summary.json``'s ``outcome``."""

    TARGET_REACHED = "target_reached"  # --until-return reached
    MAX_STEPS = "max_steps"  # --max-steps done
    INTERRUPTED = "interrupted"  # SIGINT/SIGTERM (``launcher down``, Ctrl-C, the launcher's teardown)
    STOPPED = "stopped"  # stopped for no recorded reason
    FAILED = "failed"  # an exception ended it: summary.json's ``error``

    def __str__(self) -> str:
        return str(self.value)

    @property
    def finished(self) -> bool:
        """The run did what it was asked to."""
        return self in (Outcome.TARGET_REACHED, Outcome.MAX_STEPS)

    @classmethod
    def parse(cls, value: Any) -> "Outcome | None":
        """The outcome ``summary.json`` names, or None (none written, or not one of ours)."""
        try:
            return cls(value)
        except ValueError:
            return None
