"""The learner recovered in place (issue 27): which dead master the supervisor replaces, and when it gives up.

A run's actors hold nothing worth keeping; its learner's state is in its checkpoints. So when the master
process or container dies *by a signal* (SIGKILL, the OOM killer, a segfault) without recording how the run
ended, the supervisor asks the backend for a new master of the same run: same command, environment, GPU
leases, run secret and address (the process backend keeps the listening socket; a container keeps its name on
the run's network, and so does a swarm service's new task). The new master restores the newest intact checkpoint (counters, optimiser, normalisation
statistics); the groups, which never stopped, reconnect with their back-off and train on, and whatever they
collected against the old weights is judged by the normal policy-lag rule. The new master records the
recovery (:mod:`worker.recovery`); this module decides and counts.

Not recovered, because a second master would end the same way or someone meant it: a master that recorded an
end (``summary.json`` written since it started: finished, failed on an error, stopped by SIGTERM / ``docker
stop`` / an engine shutdown), one that exited with a code rather than a signal, one the backend cannot
replace now (:meth:`~launcher.backends.base.Backend.master_recovery_blocked`: on Slurm, its node lost), and any
master once the budget is spent: ``--master-restarts K`` deaths in a row, each within :data:`RESTART_WINDOW_S`
of the previous (re)start, end the run with exit 7 as before (K = 0 turns recovery off). A master that lived
longer than the window starts the count again.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

RESTART_WINDOW_S = 60.0


def death_signal(exit_code: int | None) -> int | None:
    """The signal that ended a master, from its exit code as a backend reports it (a process: ``-N``; a
    container's main process: ``128 + N``), or None when it exited on its own."""
    if exit_code is None or isinstance(exit_code, bool):
        return None
    if exit_code < 0:
        return -exit_code
    if 128 < exit_code <= 128 + 64:
        return exit_code - 128
    return None


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def stamp(path: Path) -> int | None:
    """``path``'s modification time (ns), or None when there is none: tells a summary written since from one
    left by an earlier master (``--resume``)."""
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


@dataclass(frozen=True)
class Verdict:
    recover: bool
    why: str  # recover: the event line's tail; else why not (for the failure message)
    blocked: bool = False  # not replaced because the backend cannot now (its reason is the likelier cause)


@dataclass
class MasterRecovery:
    """The run's master restart budget. ``clock`` is injectable (tests run a run's life in a second)."""

    budget: int
    window_s: float = RESTART_WINDOW_S
    clock: Callable[[], float] = time.monotonic
    deaths: list[dict[str, Any]] = field(default_factory=list)  # each recovery: when, the signal, the exit code
    _in_a_row: int = 0
    _started: float | None = None

    def started(self) -> None:
        """The master (first or a new one) was started now."""
        self._started = self.clock()

    def judge(self, exit_code: int | None, *, ended_on_record: bool, supported: bool, backend: str,
              blocked: Callable[[], str | None] | None = None) -> Verdict:
        """Whether to replace a master that just died. ``blocked``: why the backend cannot replace this one now (None:
        it can); asked of a backend that replaces masters, before the exit code, since the reason (the master's
        node lost) also explains an end without a signal."""
        if ended_on_record:
            return Verdict(False, "it recorded how the run ended")
        why_not = blocked() if supported and blocked is not None else None
        if why_not:
            return Verdict(False, why_not, blocked=True)
        signum = death_signal(exit_code)
        if signum is None:
            return Verdict(False, f"it exited with code {exit_code} (not killed by a signal)")
        if not supported:
            return Verdict(False, f"the {backend} backend does not replace a dead master")
        if self.budget <= 0:
            return Verdict(False, "--master-restarts is 0")
        quick = self._started is not None and self.clock() - self._started < self.window_s
        in_a_row = self._in_a_row + 1 if quick else 1
        if in_a_row > self.budget:
            return Verdict(False, f"it died {in_a_row} times in a row, each within {self.window_s:.0f} s of its "
                                  f"start (--master-restarts {self.budget})")
        self._in_a_row = in_a_row
        self.deaths.append({"at": round(time.time(), 3), "signal": signal_name(signum), "exit_code": exit_code})
        return Verdict(True, f"killed by {signal_name(signum)}; starting a new master from the newest checkpoint "
                             f"({in_a_row} of {self.budget} in a row)")
