"""One run reads the same through `launcher status`, `launcher runs` and their `--json` (issue 23, item 1).

Each case is a real results directory; a process run's parts are real processes that have exited, a Docker run's
containers come from a stand-in engine (only the engine is faked: no Docker in the unit tests). Before the run
states were derived in one place, `status` called a detached run that ended on its own ``ended`` and `runs`
``finished``; a master that exited non-zero was ``failed`` in one and ``running``/``stale`` in the other; and
`runs` dropped the outcome of a run whose record still said live.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from launcher import schemas
from launcher.backends.docker import DockerBackend
from launcher.backends.docker_run import DockerRun
from launcher.cli.main import main
from launcher.engine.client import Container
from tests.engine_snapshots import SnapshotEngine, snap
from launcher.runs import RunDir, create_run_dir
from launcher.schemas import RUN_STATUS_SCHEMA, RUNS_SCHEMA
from launcher.runstate import Seen, derive_state, end_state
from worker.ending import Outcome, RunState
from worker.results import atomic_write_json

ERROR = {"type": "ZeroDivisionError", "message": "division by zero", "where": "the learner's update (ppo.py:42)"}


def _gone_pid() -> int:
    """The pid of a real process that has exited (the process backend's master after its end)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# name, backend, record, summary, containers (docker) , expected state, expected outcome
CASES: list[tuple[str, str, dict[str, Any], dict[str, Any] | None, list[Container] | None, str, str | None]] = [
    ("ended-detached", "docker", {"state": "running", "detached": True}, {"outcome": "max_steps"},
     [snap("master", "exited", 0), snap("group", "exited", 0, "0")], "finished", "max_steps"),
    ("master-died-groups-retrying", "docker", {"state": "running", "detached": True}, None,
     [snap("master", "exited", 137), snap("group", "restarting", None, "0")], "failed", "failed"),
    ("master-raised", "docker", {"state": "running", "detached": True}, {"outcome": "failed", "error": ERROR},
     [snap("master", "exited", 1), snap("group", "exited", 0, "0")], "failed", "failed"),
    ("failed-process", "process", {"state": "running"}, {"outcome": "failed", "error": ERROR}, None,
     "failed", "failed"),
    ("launcher-killed-master-stopped", "process", {"state": "running"}, {"outcome": "interrupted"}, None,
     "stale", "interrupted"),
    ("launcher-killed-no-outcome", "process", {"state": "running"}, None, None, "stale", None),
    ("interrupted-recorded", "process", {"state": "interrupted", "exit_code": 130}, {"outcome": "interrupted"},
     None, "interrupted", "interrupted"),
    ("finished-recorded", "process", {"state": "finished", "exit_code": 0}, {"outcome": "target_reached"}, None,
     "finished", "target_reached"),
]


def _make(root: Path, name: str, backend: str, record: dict[str, Any], summary: dict[str, Any] | None) -> RunDir:
    rid = f"cartpole-ppo-{name}"
    rd = create_run_dir(root, rid)
    (rd.path / "spec.json").write_text("{}")
    rd.update_record(run_id=rid, backend=backend, **record,
                     **({"pids": {"master": _gone_pid(), "group-0": _gone_pid()}} if backend == "process" else {}))
    if summary is not None:
        atomic_write_json(rd.files.summary, summary)
    return rd


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_status_runs_and_json_agree(case: tuple[Any, ...], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    name, backend, record, summary, snaps, state, outcome = case
    rd = _make(tmp_path, name, backend, record, summary)
    if snaps is not None:
        engine = SnapshotEngine(snaps)
        monkeypatch.setattr(DockerBackend, "find", classmethod(
            lambda cls, run_id, run_dir, rec: DockerRun(run_id, run_dir, rec, engine=engine)))  # type: ignore[arg-type]
    monkeypatch.setattr(DockerBackend, "live_run_ids", classmethod(lambda cls, root, *, user: set()))
    args = ["--results", str(tmp_path)]

    assert main(["status", rd.run_id, *args, "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert main(["status", *args, "--json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)["runs"]
    assert main(["runs", *args, "--json"]) == 0
    runs_doc = json.loads(capsys.readouterr().out)
    (row,) = runs_doc["runs"]
    schemas.validator(RUN_STATUS_SCHEMA).validate(one)  # the schemas follow the one vocabulary
    schemas.validator(RUNS_SCHEMA).validate(runs_doc)
    assert main(["status", rd.run_id, *args]) == 0
    status_text = capsys.readouterr().out
    assert main(["runs", *args]) == 0
    table = capsys.readouterr().out

    seen = {"status --json": (one["state"], one["outcome"]), "status --json (all)": (listed["state"], listed["outcome"]),
            "runs --json": (row["status"], row["outcome"])}
    assert seen == dict.fromkeys(seen, (state, outcome))
    assert status_text.splitlines()[0].split()[2] == state, status_text
    assert table.splitlines()[1].split()[4] == state, table
    if summary is not None and "error" in summary:  # the root cause reads the same everywhere too
        assert one["error"] == row["error"] == "ZeroDivisionError: division by zero (in the learner's update (ppo.py:42))"
        assert "ZeroDivisionError: division by zero" in status_text


def test_old_records_still_read() -> None:
    """Records and documents written before the vocabulary was shared: `ended` was a detached run that ended,
    and anything unknown is UNKNOWN rather than an error (the record is the run's to write)."""
    assert RunState.parse("ended") == RunState.FINISHED
    assert RunState.parse("exploded") == RunState.UNKNOWN and RunState.parse(None) == RunState.UNKNOWN
    assert Outcome.parse("group_error") is None and Outcome.parse("max_steps") == Outcome.MAX_STEPS
    derived = derive_state("r", {"state": "ended"}, {"outcome": "max_steps"}, Seen())
    assert (derived.state, derived.outcome) == (RunState.FINISHED, Outcome.MAX_STEPS)


def test_live_and_terminal_partition_the_states() -> None:
    live = {s for s in RunState if s.live}
    terminal = {s for s in RunState if s.terminal}
    assert live == {RunState.PREPARING, RunState.QUEUED, RunState.STARTING, RunState.RUNNING, RunState.STOPPING}
    assert terminal == {RunState.FINISHED, RunState.FAILED, RunState.TIMED_OUT, RunState.INTERRUPTED}
    assert not (live & terminal) and {s for s in RunState if not (s.live or s.terminal)} == {RunState.STALE,
                                                                                          RunState.UNKNOWN}


@pytest.mark.parametrize(("outcome", "master_exit", "state"), [
    (Outcome.MAX_STEPS, 0, RunState.FINISHED), (Outcome.TARGET_REACHED, None, RunState.FINISHED),
    (Outcome.MAX_STEPS, 1, RunState.FAILED),  # an exit code beats an older summary
    (Outcome.FAILED, 1, RunState.FAILED), (None, 137, RunState.FAILED), (None, 0, RunState.FAILED),
    (Outcome.INTERRUPTED, 0, RunState.INTERRUPTED), (Outcome.STOPPED, None, RunState.INTERRUPTED),
    (None, None, RunState.STALE)])
def test_end_state(outcome: Outcome | None, master_exit: int | None, state: RunState) -> None:
    assert end_state(outcome, master_exit) == state


def test_a_live_run_is_believed_while_anything_of_it_runs() -> None:
    rec = {"state": "running"}
    assert derive_state("r", rec, {}, Seen(parts_alive=True)).state == RunState.RUNNING
    assert derive_state("r", {"state": "preparing"}, {}, Seen(launcher_alive=True)).state == RunState.PREPARING
    unreachable = derive_state("r", rec, {"outcome": "max_steps"}, Seen(unreachable="cannot ask the Docker engine"))
    assert (unreachable.state, unreachable.outcome, unreachable.note) == (RunState.RUNNING, None,
                                                                          "cannot ask the Docker engine")
