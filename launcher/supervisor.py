"""The supervisor: drives a backend through a run's lifecycle and decides how it ended.

States (:class:`worker.ending.RunState`, shared with ``status`` and ``runs``): PREPARING -> STARTING (QUEUED while a scheduler holds it back: Slurm) -> RUNNING ->
STOPPING -> one of FINISHED, FAILED, TIMED_OUT, INTERRUPTED. ``--timeout`` counts from RUNNING: time in a
scheduler's queue is not run time (Slurm's own time limit counts the same way). The monitor loop polls the backend and the master's ``status.json`` twice a
second, enforces ``--timeout``, reacts to SIGINT/SIGTERM, and always ends in ``backend.stop()`` (a
``finally``), so no process or container outlives an attached ``launcher up``.

The restart budget is counted here and nowhere else (PyTorch elastic's split: the monitor only reads, the
run loop decides). An engine that stops answering (a Docker restart) is waited for up to
``ENGINE_RESTART_WINDOW_S`` before the run is given up, and the teardown waits for it the same way. A backend
reports each group's restarts, whoever did them (Docker's ``on-failure``
policy, the swarm, this loop); a group that failed is restarted by the backend's own system while it can
(RESTARTING), else by :class:`Budget` after the backend's ``restart_grace_s``, until the budget is spent:
then it is LOST and the run goes on with fewer workers. Every backend looks the same from outside.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from launcher.backends.base import Backend, BackendStatus, Part, PartState, PreparedRun
from launcher.engine.errors import ENGINE_RESTART_WINDOW_S, EngineUnreachable
from launcher.errors import ExitCode, Interrupted, LauncherError
from launcher.procs import launcher_record
from launcher.recovery import MasterRecovery, death_signal, stamp
from launcher.runs import error_line
from launcher.rundata import status_doc, summary_doc
from launcher.runstate import end_state
from launcher import safefs
from launcher.safefs import read_json_at
from worker.contract import GROUP_AUTH_REFUSED_EXIT, GROUP_USER_CODE_EXIT, LOGS_DIR, group_log_name
from worker.ending import Outcome, RunState, last_fatal

log = logging.getLogger(__name__)


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
    group_errors: dict[int, str] = field(default_factory=dict)  # lost groups: what each raised last (its log)

    @property
    def error(self) -> str | None:
        """The root cause of a failed run (summary.json's error: ``Type: message (in where)``), or None."""
        return error_line(self.summary.get("error"))

    def to_dict(self) -> dict[str, Any]:
        return {"schema": "launcher.result/v1", "run_id": self.run_id, "state": self.state.value,
                "exit_code": int(self.exit_code), "message": self.message, "error": self.error, "summary": self.summary,
                "restarts": {str(k): v for k, v in self.restarts.items()}, "lost_groups": self.lost_groups,
                "group_errors": {str(k): v for k, v in self.group_errors.items()},
                "wall_s": round(self.wall_s, 2)}


Event = Callable[[str, dict[str, Any]], None]  # (kind, data): "status", "event"


# A group that exits with one of these is not restarted and spends no budget: a restart would end the same way.
NOT_RESTARTED = {
    GROUP_USER_CODE_EXIT: "stopped on an error in the algorithm's code; not restarted: its log has the traceback",
    GROUP_AUTH_REFUSED_EXIT: "was refused by the master (the run secret did not match); not restarted, the same "
                             "secret would be refused again: restart the run (`launcher down`, then `launcher up "
                             "--resume`) so every part gets one secret",
}


@dataclass
class Budget:
    """The restart budget of a run's worker groups: which failed group to restart, which is lost.

    ``grace_s``: how long a FAILED group is left to the backend's own system (its restart policy) before this
    restarts it; ``clock`` is injectable for tests.
    """

    budget: int
    grace_s: float
    clock: Callable[[], float] = time.monotonic
    raised: Callable[[int], str | None] = lambda index: None  # what killed group ``index`` last, from its log
    restarts: dict[int, int] = field(default_factory=dict)
    lost: list[int] = field(default_factory=list)
    _failed_since: dict[int, float] = field(default_factory=dict)

    def review(self, st: BackendStatus, backend: Backend, emit: Event) -> BackendStatus:
        """Restart the failed groups that have budget left (through ``backend``), mark the others LOST, and
        return ``st`` as the user should see it (a FAILED group with budget left is RESTARTING)."""
        groups: dict[int, Part] = {}
        for i, g in st.groups.items():
            self.restarts[i] = g.restarts
            if i in self.lost or g.state == PartState.LOST:
                self._lose(i, g, emit)
                groups[i] = replace(g, state=PartState.LOST)
                continue
            if g.state != PartState.FAILED:
                self._failed_since.pop(i, None)
                groups[i] = g
                continue
            if g.restarts >= self.budget or g.exit_code in NOT_RESTARTED:
                self._lose(i, g, emit)
                groups[i] = replace(g, state=PartState.LOST)
                continue
            first = self._failed_since.setdefault(i, self.clock())
            if self.clock() - first >= self.grace_s:
                self._failed_since.pop(i, None)
                emit("event", {"message": f"group {i} died (exit {g.exit_code}); restarting it "
                                          f"({g.restarts + 1} of {self.budget})"})
                backend.restart_group(i)
                self.restarts[i] = g.restarts + 1
                g = replace(g, restarts=g.restarts + 1)
            groups[i] = replace(g, state=PartState.RESTARTING)
        return BackendStatus(st.master, groups)

    def _lose(self, i: int, g: Part, emit: Event) -> None:
        if i not in self.lost:
            self.lost.append(i)
            error = self.raised(i)
            cause = f"; it raised {error}" if error else ""
            why = NOT_RESTARTED.get(g.exit_code) if g.exit_code is not None else None
            if why is not None:  # restarting would end the same way: the budget is left alone
                emit("event", {"message": f"group {i} (exit {g.exit_code}) {why}{cause}"})
                return
            emit("event", {"message": f"group {i} died (exit {g.exit_code}) and its restart budget ({self.budget}) "
                                      f"is spent; continuing with fewer workers{cause}"})

    @property
    def all_lost(self) -> bool:
        return bool(self.lost) and len(self.lost) == len(self.restarts)


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
              stop_signal: StopSignal | None = None, poll_s: float = 0.5,
              clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> RunResult:
    """Start ``run`` on ``backend`` and watch it to the end. Never leaves anything running.

    ``clock`` (seconds) and ``sleep`` are what ``--timeout``, the restart grace and the engine's outage window are
    measured with (injectable: tests run hours of a run's life in a second); between polls the backend's
    :meth:`~launcher.backends.base.Backend.idle` waits."""
    emit = on_event or (lambda kind, data: None)
    stopper = stop_signal or StopSignal()
    stopper.install()
    cfg = run.config
    started = clock()
    state = RunState.STARTING
    budget = Budget(cfg.restart_budget, backend.restart_grace_s, clock, raised=lambda i: group_error(run, i))
    recovery = MasterRecovery(cfg.master_restarts, clock=clock)
    summary_mark = stamp(run.run_dir.files.summary)  # one left by an earlier master (--resume) is not an end
    recovering: float | None = None  # since when a new master is being started in place of a dead one
    seen_recoveries = 0
    final: RunState | None = None
    failure: BaseException | None = None
    message = ""
    watch = None
    elastic = None  # launcher.elastic.Elastic of an elastic run: yields groups to the queue, grows them back
    outage: float | None = None  # since when the backend's engine has not answered
    run.run_dir.update_record(state=state.value, **{**backend.describe(), **launcher_record()})
    try:
        if stopper.requested is not None:  # a signal during planning: nothing is started (not even a build)
            raise Interrupted(f"interrupted by {signal.Signals(stopper.requested).name} before the start")
        backend.watch_stop(lambda: stopper.requested is not None)  # a start that waits in a queue gives up on it
        backend.start(run)
        recovery.started()
        running_since = clock()  # --timeout counts from here: a queued run had not started
        run.run_dir.update_record(state=RunState.RUNNING.value, **{**backend.describe(), **launcher_record()})
        state = RunState.RUNNING
        from launcher.gpu import watch as gpu_watch  # NVML only for runs on GPUs

        watch = gpu_watch.start_for(run.run_id, run.plan.gpu_uuids, backend=backend.name)
        from launcher import elastic as elastic_mod  # an elastic run, or one given GPUs by elastic runs

        elastic = elastic_mod.for_run(run, backend, emit) if run.elastic_min else None
        arrival = elastic_mod.Arrival(run)
        emit("event", {"message": f"run {run.run_id} started on the {backend.name} backend "
                                  f"({run.plan.total_workers} workers in {len(run.plan.groups)} groups)"})
        while True:
            if stopper.requested is not None:
                final, message = RunState.INTERRUPTED, f"interrupted by {signal.Signals(stopper.requested).name}"
                break
            if cfg.timeout_s is not None and clock() - running_since > cfg.timeout_s:
                final, message = RunState.TIMED_OUT, f"--timeout {cfg.timeout_s:g} s elapsed"
                break
            try:
                st = budget.review(backend.poll(), backend, emit)
            except EngineUnreachable as exc:  # an engine restart: wait for it (a while), do not abandon the run
                if outage is None:
                    outage = clock()
                    emit("event", {"message": f"{exc.message}; waiting up to {ENGINE_RESTART_WINDOW_S:.0f} s "
                                              "for it to come back"})
                elif clock() - outage > ENGINE_RESTART_WINDOW_S:
                    raise
                sleep(1.0)
                continue
            if outage is not None:
                emit("event", {"message": f"the engine answers again after {clock() - outage:.1f} s"})
                outage = None
            if elastic is not None and st.master.state.alive:
                elastic.review(st)
            arrival.tell()
            if watch is not None:  # foreign processes on the run's GPUs: an event and run.json's gpu_watch
                watch.review(emit, run.run_dir.update_record)
            status = status_doc(read_json_at(run.run_dir.files.status))  # the run's to write: typed first
            if status:
                emit("status", {"status": status, "backend": st, "restarts": dict(budget.restarts)})
                recs = status.get("recoveries") or []
                if recovering is not None and len(recs) > seen_recoveries:
                    r = recs[-1]
                    emit("event", {"message": f"the new master is up {clock() - recovering:.1f} s after the death, "
                                              f"from checkpoint {r.get('checkpoint')} ({r.get('restored_env_steps')} "
                                              f"env steps; {r.get('steps_lost')} lost)"})
                    recovering = None
                seen_recoveries = max(seen_recoveries, len(recs))
            if not st.master.state.alive:
                verdict = recovery.judge(st.master.exit_code, supported=backend.recovers_master, backend=backend.name,
                                         ended_on_record=stamp(run.run_dir.files.summary) != summary_mark,
                                         blocked=backend.master_recovery_blocked)
                if verdict.recover:
                    emit("event", {"message": f"the master died ({verdict.why})"})
                    backend.restart_master()
                    recovery.started()
                    recovering = clock()
                    run.run_dir.update_record(master_recoveries=recovery.deaths, **backend.describe())
                    continue
                backend.fetch_results()
                final, message = _master_ended(run, st)
                if final == RunState.FAILED and (verdict.blocked or death_signal(st.master.exit_code) is not None):
                    message += f" (not replaced: {verdict.why})"
                break
            if budget.all_lost:
                final, message = RunState.FAILED, "every worker group died and their restart budgets are spent"
                break
            backend.idle(poll_s)
    except BaseException as exc:
        interrupted = isinstance(exc, LauncherError) and exc.exit_code == ExitCode.INTERRUPTED  # e.g. during a build
        final = final or (RunState.INTERRUPTED if interrupted else RunState.FAILED)
        failure = exc
        raise
    finally:
        if watch is not None:
            watch.stop()
        if elastic is not None:
            elastic.close()
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
    summary = summary_doc(read_json_at(run.run_dir.files.summary))
    assert final is not None
    group_errors = {i: e for i in budget.lost if (e := group_error(run, i))}
    if final == RunState.FAILED:  # e.g. a group's code raised: it was lost first, the master ended on its error
        message = _error_message(run, summary) or message
        if budget.all_lost and group_errors and not summary.get("error"):
            message += "; " + "; ".join(f"group {i} last raised {e}" for i, e in sorted(group_errors.items()))
    code = _exit_code(final, summary, cfg.until_return)
    if final == RunState.FINISHED and code == ExitCode.TARGET_NOT_REACHED:
        message = (f"--until-return {cfg.until_return:g} not reached within --max-steps {cfg.max_steps}: "
                   f"mean return {summary.get('mean_return')}")
    result = RunResult(run.run_id, final, code, message, summary, dict(budget.restarts), list(budget.lost),
                       clock() - started, group_errors)
    run.run_dir.update_record(state=final.value, exit_code=int(code), message=message, ended=time.time())
    return result


def group_error(run: PreparedRun, index: int) -> str | None:
    """What killed group ``index`` last, as ``Type: message (in where)``: the fatal line it wrote last in its
    log (:func:`worker.ending.fatal_line`); None when its log has none (yet) or cannot be read."""
    try:
        tail = safefs.read_tail(run.run_dir.path, f"{LOGS_DIR}/{group_log_name(index)}", max_bytes=64 * 1024)
    except OSError:  # none (a container backend keeps logs at teardown), or not a file to trust (UnsafeFile)
        return None
    return error_line(last_fatal(tail.decode(errors="replace")))


def _master_ended(run: PreparedRun, st: BackendStatus) -> tuple[RunState, str]:
    """How the run ended once its master did, as ``launcher status`` and ``runs`` will say it
    (:func:`launcher.runstate.end_state`)."""
    summary = summary_doc(read_json_at(run.run_dir.files.summary))
    outcome = Outcome.parse(summary.get("outcome"))
    state = end_state(outcome, st.master.exit_code)
    if state == RunState.FINISHED and outcome is not None:
        return state, f"run {outcome.value.replace('_', ' ')}"
    if state == RunState.INTERRUPTED and outcome is not None:
        # Someone else stopped the master (`docker stop`, an engine restart, a signal to its pid): this launcher
        # was not interrupted, its run failed; exit 7 as for any master that did not finish (a CI job must not
        # read 130, "you pressed Ctrl-C"). tests/docker/test_engine_restart.py is the real case.
        return RunState.FAILED, (f"the master was stopped ({outcome.value}) by someone other than this launcher; "
                       f"`launcher up --resume {run.run_id}` continues from the last checkpoint")
    return RunState.FAILED, _error_message(run, summary) or (
        f"the master exited with code {st.master.exit_code} (outcome {summary.get('outcome', 'unknown')}); see "
        f"{run.run_dir.files.logs}/master.log and resume with `launcher up --resume {run.run_id}`")


def _error_message(run: PreparedRun, summary: dict[str, Any]) -> str | None:
    """The root cause of a failed run, from ``summary.json``'s error (what raised, where, which log has the
    traceback), or None when the master recorded none."""
    error = error_line(summary.get("error"))
    if not error:
        return None
    where = summary["error"].get("where", "")
    group = where.split()[1].rstrip(":") if where.startswith("group ") and len(where.split()) > 1 else None
    log_name = f"group-{group}.log" if group is not None and group.isdigit() else "master.log"
    return (f"the run failed: {error}; the traceback is in {run.run_dir.files.logs}/{log_name}"
            + ("" if group is not None else f"; `launcher up --resume {run.run_id}` continues from the last "
                                            "checkpoint"))


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
