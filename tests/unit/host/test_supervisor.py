"""The supervisor without processes (issue 23, item 6): a scripted backend and an injected clock drive
``supervise()`` through a timeout, SIGINT/SIGTERM, an engine outage shorter and longer than its window, a group
that keeps dying until its restart budget is spent, a group whose secret the master refused, and a master
killed by a signal (replaced in place, issue 27) or ending on purpose (not replaced).

Only the backend is scripted (what a run's parts do, second by second); the signals are real (delivered to this
process and caught by the supervisor's own handlers), the run's directory and record are real files. A run's
hours pass in milliseconds: the clock moves only when the supervisor waits.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from launcher.backends.base import Backend, BackendStatus, Part, PartState, PreparedRun
from launcher.config import RunConfig
from launcher.engine.errors import ENGINE_RESTART_WINDOW_S, EngineUnreachable
from launcher.errors import ExitCode
from launcher.gpu.placement import PlanRequest, cpu_plan
from launcher.runs import create_run_dir, new_secret
from launcher.runstate import Seen, derive_state
from launcher.supervisor import RunResult, StopSignal, supervise
from launcher.up import build_spec
from worker.contract import GROUP_AUTH_REFUSED_EXIT, GROUP_USER_CODE_EXIT
from worker.ending import RunState, fatal_line
from worker.results import atomic_write_json

T0 = 1000.0


class Clock:
    """Seconds that pass only when someone waits."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class ScriptedBackend(Backend):
    """A backend whose parts do what the test says, at the times it says (seconds after the start).

    ``master_ends``: (when, exit code, summary.json's outcome), None: it runs until stopped. ``dies``: group ->
    (seconds after each (re)start it dies, its exit code). ``outage``: (from, to) the engine does not answer.
    ``signal_at``: (when, signal) delivered to this process, as a user's Ctrl-C or ``kill`` would.
    ``master_kills``: seconds after each master (re)start at which it is SIGKILLed (no summary written); a new
    master comes up on ``restart_master``, unless ``recovery_blocked`` says why it cannot (the Slurm backend: the
    master's node lost).
    """

    clock: Clock
    groups: int = 2
    master_ends: tuple[float, int, str] | None = None
    dies: dict[int, tuple[float, int]] = field(default_factory=dict)
    outage: tuple[float, float] | None = None
    signal_at: tuple[float, int] | None = None
    master_kills: list[float] = field(default_factory=list)
    master_restarts: int = 0
    master_started: float = 0.0
    recovery_blocked: str | None = None
    run: PreparedRun | None = None
    started_at: dict[int, float] = field(default_factory=dict)
    restarted: dict[int, int] = field(default_factory=dict)
    stops: int = 0
    polls: int = 0

    name = "scripted"
    restart_grace_s = 0.0
    recovers_master = True

    def start(self, run: PreparedRun) -> None:
        self.run = run
        self.t_start = self.master_started = self.clock()
        self.started_at = dict.fromkeys(range(self.groups), self.t_start)
        self.restarted = dict.fromkeys(range(self.groups), 0)

    def poll(self) -> BackendStatus:
        assert self.run is not None
        self.polls += 1
        t = self.clock() - self.t_start
        if self.signal_at is not None and t >= self.signal_at[0]:
            sig, self.signal_at = self.signal_at[1], None
            signal.raise_signal(sig)
        if self.outage is not None and self.outage[0] <= t < self.outage[1]:
            raise EngineUnreachable("the Docker engine does not answer (connection refused)")
        master = Part("master", PartState.RUNNING)
        if self.master_ends is not None and t >= self.master_ends[0]:
            _, code, outcome = self.master_ends
            if not self.run.run_dir.files.summary.exists():
                atomic_write_json(self.run.run_dir.files.summary, {"outcome": outcome})
            master = Part("master", PartState.EXITED if code == 0 else PartState.FAILED, exit_code=code)
        if self.master_kills and self.clock() - self.master_started >= self.master_kills[0]:
            master = Part("master", PartState.FAILED, exit_code=-signal.SIGKILL, restarts=self.master_restarts)
        groups = {}
        for i in range(self.groups):
            after, code = self.dies.get(i, (float("inf"), 0))
            dead = self.clock() - self.started_at[i] >= after
            groups[i] = Part(f"group-{i}", PartState.FAILED if dead else PartState.RUNNING,
                             exit_code=code if dead else None, restarts=self.restarted[i])
        return BackendStatus(master, groups)

    def master_recovery_blocked(self) -> str | None:
        return self.recovery_blocked

    def restart_master(self) -> None:
        self.master_kills.pop(0)
        self.master_restarts += 1
        self.master_started = self.clock()

    def restart_group(self, index: int) -> None:
        self.restarted[index] += 1
        self.started_at[index] = self.clock()

    def stop(self, *, grace_s: float = 8.0) -> None:
        self.stops += 1

    def idle(self, seconds: float) -> None:
        self.clock.sleep(seconds)


@dataclass
class Supervised:
    result: RunResult | None
    error: BaseException | None
    events: list[str]
    record: dict[str, Any]
    backend: ScriptedBackend
    wall_s: float

    def said(self, text: str) -> bool:
        return any(text in e for e in self.events)


def supervised(tmp_path: Path, backend: ScriptedBackend, **config: Any) -> Supervised:
    """``supervise()`` a two-worker-per-group run on ``backend`` with ``config`` (RunConfig fields)."""
    cfg = RunConfig(workers=2 * backend.groups, results=tmp_path, max_steps=1_000_000, **config)
    plan = cpu_plan(PlanRequest(workers=cfg.workers, max_workers_per_group=2), 2)
    rd = create_run_dir(tmp_path, "cartpole-ppo-scripted-0001")
    run = PreparedRun(cfg, plan, build_spec(cfg, plan, rd.run_id, rd.path), rd, new_secret())
    events: list[str] = []
    on_event = lambda kind, data: events.append(data["message"]) if kind == "event" else None  # noqa: E731
    result, error = None, None
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    t0 = time.monotonic()
    try:
        result = supervise(run, backend, on_event=on_event, stop_signal=StopSignal(), clock=backend.clock,
                           sleep=backend.clock.sleep)
    except Exception as exc:  # noqa: BLE001 - the test looks at what came out
        error = exc
    wall = time.monotonic() - t0
    assert {s: signal.getsignal(s) for s in before} == before, "the signal handlers are given back"
    assert backend.stops == 1, "the teardown always runs, once"
    record = rd.read_record()
    # Whatever the supervisor decided is what `launcher status` and `runs` will say (one derivation).
    derived = derive_state(rd.run_id, record, {}, Seen())
    assert derived.state == RunState(record["state"]) and derived.state.terminal
    return Supervised(result, error, events, record, backend, wall)


def test_timeout_tears_down_and_exits_4(tmp_path: Path) -> None:
    clock = Clock()
    s = supervised(tmp_path, ScriptedBackend(clock), timeout_s=3600.0)
    assert s.result is not None and (s.result.state, s.result.exit_code) == (RunState.TIMED_OUT, ExitCode.TIMEOUT)
    assert s.result.message == "--timeout 3600 s elapsed" and 3600 <= clock.now - T0 <= 3601
    assert (s.record["state"], s.record["exit_code"]) == ("timed_out", 4)
    assert s.wall_s < 5, "an hour of a run supervised in seconds"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_interrupts_the_run(tmp_path: Path, sig: int) -> None:
    s = supervised(tmp_path, ScriptedBackend(Clock(), signal_at=(30.0, sig)), timeout_s=3600.0)
    assert s.result is not None and (s.result.state, s.result.exit_code) == (RunState.INTERRUPTED, 130)
    assert s.result.message == f"interrupted by {signal.Signals(sig).name}"
    assert (s.record["state"], s.record["exit_code"]) == ("interrupted", 130)


def test_an_engine_outage_shorter_than_its_window_is_waited_out(tmp_path: Path) -> None:
    outage = ENGINE_RESTART_WINDOW_S / 2
    backend = ScriptedBackend(Clock(), outage=(10.0, 10.0 + outage), master_ends=(100.0, 0, "max_steps"))
    s = supervised(tmp_path, backend)
    assert s.result is not None and (s.result.state, s.result.exit_code) == (RunState.FINISHED, ExitCode.OK)
    assert s.said(f"waiting up to {ENGINE_RESTART_WINDOW_S:.0f} s for it to come back")
    assert s.said("the engine answers again after")
    assert s.record["state"] == "finished"


def test_an_engine_outage_longer_than_its_window_gives_the_run_up(tmp_path: Path) -> None:
    clock = Clock()
    s = supervised(tmp_path, ScriptedBackend(clock, outage=(10.0, 1e9)))
    assert isinstance(s.error, EngineUnreachable) and s.result is None
    assert ENGINE_RESTART_WINDOW_S < clock.now - T0 - 10 <= ENGINE_RESTART_WINDOW_S + 2
    assert (s.record["state"], s.record["exit_code"]) == ("failed", int(ExitCode.MISSING_DEPENDENCY))
    assert "does not answer" in s.record["message"]


def test_a_group_that_keeps_dying_spends_its_budget_then_the_run_goes_on(tmp_path: Path) -> None:
    backend = ScriptedBackend(Clock(), dies={0: (5.0, 1)}, master_ends=(120.0, 0, "max_steps"))
    s = supervised(tmp_path, backend, restart_budget=2)
    assert s.result is not None and s.result.state == RunState.FINISHED
    assert backend.restarted == {0: 2, 1: 0} and s.result.restarts == {0: 2, 1: 0} and s.result.lost_groups == [0]
    assert s.said("group 0 died (exit 1); restarting it (1 of 2)") and s.said("restarting it (2 of 2)")
    assert s.said("group 0 died (exit 1) and its restart budget (2) is spent; continuing with fewer workers")


def test_when_every_group_spent_its_budget_the_run_failed(tmp_path: Path) -> None:
    backend = ScriptedBackend(Clock(), groups=1, dies={0: (5.0, 137)})
    s = supervised(tmp_path, backend, restart_budget=3)
    assert s.result is not None and (s.result.state, s.result.exit_code) == (RunState.FAILED, ExitCode.RUN_FAILED)
    assert backend.restarted == {0: 3} and s.result.lost_groups == [0]
    assert s.result.message == "every worker group died and their restart budgets are spent"


@pytest.mark.parametrize("code,says", [(GROUP_AUTH_REFUSED_EXIT, "run secret did not match"),
                                       (GROUP_USER_CODE_EXIT, "error in the algorithm's code")])
def test_a_refused_or_broken_group_is_not_restarted_and_spends_no_budget(tmp_path: Path, code: int, says: str) -> None:
    backend = ScriptedBackend(Clock(), dies={0: (5.0, code)}, master_ends=(60.0, 0, "max_steps"))
    s = supervised(tmp_path, backend, restart_budget=3)
    assert backend.restarted == {0: 0, 1: 0}, "a restart would end the same way"
    assert s.result is not None and s.result.restarts == {0: 0, 1: 0} and s.result.lost_groups == [0]
    assert s.said(f"group 0 (exit {code}) ") and s.said(says) and not s.said("restarting it")


@pytest.mark.parametrize("master,state,code", [
    ((50.0, 0, "target_reached"), RunState.FINISHED, ExitCode.OK),
    ((50.0, 1, "failed"), RunState.FAILED, ExitCode.RUN_FAILED),
    ((50.0, 137, "max_steps"), RunState.FAILED, ExitCode.RUN_FAILED),  # killed: an older summary is not believed
    ((50.0, 0, "interrupted"), RunState.FAILED, ExitCode.RUN_FAILED),  # someone else stopped the master: it failed
])
def test_the_masters_end_decides_the_runs(tmp_path: Path, master: tuple[float, int, str], state: RunState,
                                          code: ExitCode) -> None:
    s = supervised(tmp_path, ScriptedBackend(Clock(), master_ends=master))
    assert s.result is not None and (s.result.state, s.result.exit_code) == (state, code), s.result


def test_a_lost_groups_last_exception_is_named(tmp_path: Path) -> None:
    """A group that dies of an exception writes a fatal line last in its log (worker/__main__.py; tested for
    real in test_root_cause.py): the supervisor names it when the group is lost and when the run fails."""
    backend = ScriptedBackend(Clock(), groups=1, dies={0: (5.0, 1)})
    doc = {"type": "NameNotFound", "message": "Environment `NoSuchEnv` doesn't exist.", "where": "group 0: starting"}
    original_start = backend.start

    def start(run: PreparedRun) -> None:
        original_start(run)
        (run.run_dir.files.logs / "group-0.log").write_text("INFO starting\nTraceback ...\n" + fatal_line(doc) + "\n")
    backend.start = start  # type: ignore[method-assign]
    s = supervised(tmp_path, backend, restart_budget=1)
    line = "NameNotFound: Environment `NoSuchEnv` doesn't exist. (in group 0: starting)"
    assert s.result is not None and s.result.state == RunState.FAILED and s.result.group_errors == {0: line}
    assert s.result.message.endswith(f"; group 0 last raised {line}")
    assert s.said(f"is spent; continuing with fewer workers; it raised {line}")
    assert s.result.to_dict()["group_errors"] == {"0": line}


def test_a_master_killed_by_a_signal_is_replaced_in_place_and_the_groups_are_left_alone(tmp_path: Path) -> None:
    """Issue 27: three SIGKILLs, each after the master lived past the window, and the run still ends as its
    master says; the groups were never restarted."""
    backend = ScriptedBackend(Clock(), master_kills=[90.0, 100.0, 70.0], master_ends=(400.0, 0, "target_reached"))
    s = supervised(tmp_path, backend, master_restarts=1)  # each death after > 60 s of life: never "in a row"
    assert s.result is not None and (s.result.state, s.result.exit_code) == (RunState.FINISHED, ExitCode.OK)
    assert backend.master_restarts == 3 and backend.restarted == {0: 0, 1: 0}
    assert sum("the master died (killed by SIGKILL; starting a new master from the newest checkpoint" in e
               for e in s.events) == 3
    assert [d["signal"] for d in s.record["master_recoveries"]] == ["SIGKILL"] * 3


def test_a_master_that_dies_again_and_again_right_after_its_start_ends_the_run(tmp_path: Path) -> None:
    backend = ScriptedBackend(Clock(), master_kills=[5.0] * 10)
    s = supervised(tmp_path, backend, master_restarts=2)
    assert s.result is not None and (s.result.state, s.result.exit_code) == (RunState.FAILED, ExitCode.RUN_FAILED)
    assert backend.master_restarts == 2
    assert "not replaced: it died 3 times in a row, each within 60 s of its start (--master-restarts 2)" \
        in s.result.message
    assert "launcher up --resume" in s.result.message


@pytest.mark.parametrize("case", ["recorded an end", "exit code", "off", "backend", "node lost"])
def test_a_master_is_not_replaced_when_a_new_one_would_end_the_same_way(tmp_path: Path, case: str) -> None:
    backend = ScriptedBackend(Clock(), master_kills=[20.0])
    config: dict[str, Any] = {}
    if case == "recorded an end":  # SIGTERM'd, it wrote its summary: someone meant it
        backend = ScriptedBackend(Clock(), master_ends=(20.0, 143, "interrupted"))
    elif case == "exit code":
        backend = ScriptedBackend(Clock(), master_ends=(20.0, 1, "failed"))
    elif case == "off":
        config["master_restarts"] = 0
    elif case == "node lost":  # Slurm: a new master elsewhere would be at an address no group dials
        backend.recovery_blocked = "the master's node is lost (node node1 lost at 2026-11-28T12:00:00)"
    else:
        backend.recovers_master = False  # type: ignore[misc]
    s = supervised(tmp_path, backend, **config)
    assert s.result is not None and (s.result.state, s.result.exit_code) == (RunState.FAILED, ExitCode.RUN_FAILED)
    assert backend.master_restarts == 0 and not s.said("the master died (")
    if case == "off":
        assert "not replaced: --master-restarts is 0" in s.result.message
    if case == "backend":
        assert "not replaced: the scripted backend does not replace a dead master" in s.result.message
    if case == "node lost":
        assert "not replaced: the master's node is lost (node node1 lost at" in s.result.message
