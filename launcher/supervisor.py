"""The supervisor: drives a backend through a run's lifecycle and decides how it ended.

States (``RunState``): PREPARING -> STARTING -> RUNNING -> STOPPING -> one of FINISHED, FAILED,
TIMED_OUT, INTERRUPTED. The monitor loop polls the backend and the master's ``status.json`` twice a
second, restarts dead worker groups within the restart budget (unless the backend does that itself),
enforces ``--timeout``, reacts to SIGINT/SIGTERM, and always ends in ``backend.stop()`` (a ``finally``),
so no process or container outlives an attached ``launcher up``.
"""

from __future__ import annotations

import enum
import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from launcher.backends.base import Backend, BackendStatus, PreparedRun, ProcState
from launcher.errors import ExitCode, LauncherError
from worker.results import read_json

log = logging.getLogger(__name__)


class RunState(str, enum.Enum):
    PREPARING = "preparing"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    FINISHED = "finished"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    INTERRUPTED = "interrupted"


@dataclass
class RunResult:
    """How a run ended, for the summary line, ``--json`` and the exit code."""

    run_id: str
    state: RunState
    exit_code: ExitCode
    message: str
    summary: dict[str, Any] = field(default_factory=dict)
    restarts: dict[int, int] = field(default_factory=dict)
    lost_groups: list[int] = field(default_factory=list)
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"schema": "launcher.result/v1", "run_id": self.run_id, "state": self.state.value,
                "exit_code": int(self.exit_code), "message": self.message, "summary": self.summary,
                "restarts": {str(k): v for k, v in self.restarts.items()}, "lost_groups": self.lost_groups,
                "wall_s": round(self.wall_s, 2)}


Event = Callable[[str, dict[str, Any]], None]  # (kind, data): "status", "event"


class StopSignal:
    """SIGINT/SIGTERM turn into a flag the monitor loop reads; a second signal escalates."""

    def __init__(self) -> None:
        self.requested: int | None = None
        self.count = 0
        self._old: dict[int, Any] = {}

    def install(self) -> None:
        # Installed already (up() installs before planning, then hands the same one to supervise()): a second
        # install would save our own handler as the "original" and restore() would leave it in place.
        if self._old or threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        self.requested = signum
        self.count += 1

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()


def supervise(run: PreparedRun, backend: Backend, *, on_event: Event | None = None,
              stop_signal: StopSignal | None = None, poll_s: float = 0.5) -> RunResult:
    """Start ``run`` on ``backend`` and watch it to the end. Never leaves anything running."""
    emit = on_event or (lambda kind, data: None)
    stopper = stop_signal or StopSignal()
    stopper.install()
    cfg = run.config
    started = time.monotonic()
    state = RunState.STARTING
    restarts: dict[int, int] = {}
    lost: list[int] = []
    final: RunState | None = None
    failure: BaseException | None = None
    message = ""
    run.run_dir.update_record(state=state.value, **backend.describe())
    try:
        backend.start(run)
        run.run_dir.update_record(state=RunState.RUNNING.value, **backend.describe())
        state = RunState.RUNNING
        emit("event", {"message": f"run {run.run_id} started on the {backend.name} backend "
                                  f"({run.plan.total_workers} workers in {len(run.plan.groups)} groups)"})
        while True:
            if stopper.requested is not None:
                final, message = RunState.INTERRUPTED, f"interrupted by {signal.Signals(stopper.requested).name}"
                break
            if cfg.timeout_s is not None and time.monotonic() - started > cfg.timeout_s:
                final, message = RunState.TIMED_OUT, f"--timeout {cfg.timeout_s:g} s elapsed"
                break
            st = backend.poll()
            status = read_json(run.run_dir.files.status)
            if status:
                emit("status", {"status": status, "backend": st, "restarts": dict(restarts)})
            if st.master.state in (ProcState.EXITED, ProcState.FAILED, ProcState.LOST):
                final, message = _master_ended(run, st)
                break
            if not backend.restarts_groups:
                _restart_dead_groups(backend, st, cfg.restart_budget, restarts, lost, emit)
            else:
                for i, g in st.groups.items():
                    restarts[i] = g.restarts
                    if g.state == ProcState.LOST and i not in lost:
                        lost.append(i)
                        emit("event", {"message": f"group {i} lost: its restart budget is spent; "
                                                  f"continuing with fewer workers"})
            if lost and len(lost) == len(st.groups):
                final, message = RunState.FAILED, "every worker group died and their restart budgets are spent"
                break
            time.sleep(poll_s)
    except BaseException as exc:
        final = final or RunState.FAILED
        failure = exc
        raise
    finally:
        run.run_dir.update_record(state=RunState.STOPPING.value)
        emit("event", {"message": "stopping: master first (final checkpoint), then the worker groups"})
        try:
            backend.stop(grace_s=8.0)
        finally:
            stopper.restore()
            if failure is not None:  # the error goes up to the CLI; the record still says how the run ended
                code = failure.exit_code if isinstance(failure, LauncherError) else ExitCode.INTERNAL
                run.run_dir.update_record(state=(final or RunState.FAILED).value, exit_code=int(code),
                                          message=str(failure) or type(failure).__name__, ended=time.time())
    summary = read_json(run.run_dir.files.summary) or {}
    assert final is not None
    code = _exit_code(final, summary, cfg.until_return)
    if final == RunState.FINISHED and code == ExitCode.TARGET_NOT_REACHED:
        message = (f"--until-return {cfg.until_return:g} not reached within --max-steps {cfg.max_steps}: "
                   f"mean return {summary.get('mean_return')}")
    result = RunResult(run.run_id, final, code, message, summary, restarts, lost, time.monotonic() - started)
    run.run_dir.update_record(state=final.value, exit_code=int(code), message=message, ended=time.time())
    return result


def _master_ended(run: PreparedRun, st: BackendStatus) -> tuple[RunState, str]:
    summary = read_json(run.run_dir.files.summary) or {}
    if st.master.state == ProcState.EXITED and summary.get("outcome") in ("target_reached", "max_steps"):
        return RunState.FINISHED, f"run {summary['outcome'].replace('_', ' ')}"
    return RunState.FAILED, (f"the master exited with code {st.master.exit_code} "
                             f"(outcome {summary.get('outcome', 'unknown')}); see {run.run_dir.files.logs}/master.log"
                             f" and resume with `launcher up --resume {run.run_id}`")


def _restart_dead_groups(backend: Backend, st: BackendStatus, budget: int, restarts: dict[int, int],
                         lost: list[int], emit: Event) -> None:
    for i, g in st.groups.items():
        if g.state != ProcState.FAILED or i in lost:
            continue
        used = restarts.get(i, 0)
        if used < budget:
            restarts[i] = used + 1
            emit("event", {"message": f"group {i} died (exit {g.exit_code}); restarting it "
                                      f"({used + 1} of {budget})"})
            backend.restart_group(i)
        else:
            lost.append(i)
            emit("event", {"message": f"group {i} died (exit {g.exit_code}) and its restart budget ({budget}) "
                                      f"is spent; continuing with fewer workers"})


def _exit_code(final: RunState, summary: dict[str, Any], until_return: float | None) -> ExitCode:
    if final == RunState.INTERRUPTED:
        return ExitCode.INTERRUPTED
    if final == RunState.TIMED_OUT:
        return ExitCode.TIMEOUT
    if final == RunState.FAILED:
        return ExitCode.RUN_FAILED
    if until_return is not None and not summary.get("target_reached"):
        return ExitCode.TARGET_NOT_REACHED
    return ExitCode.OK
