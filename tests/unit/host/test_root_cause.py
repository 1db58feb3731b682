"""The root cause travels (issue 23, item 3): an exception that ends the master reaches summary.json,
`launcher status` (text and --json), `launcher up --json`/result.json and the progress output's end line, by
type and message. A real run on the process backend whose checkpoint directory is replaced by a file while it
runs (the disk under it went wrong): the master's next checkpoint raises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from launcher.progress import parse_plain_line
from tests.helpers import (ROOT, child_env, launcher_cmd, only_run, processes_mentioning, read_json, run_launcher,
                           status_of, wait_for)
from worker.contract import EXIT_FAILED, RunSpec


def test_a_master_that_raises_during_a_run_is_named_everywhere(tmp_path: Path) -> None:
    proc = subprocess.Popen(launcher_cmd("up", "--backend", "process", "--gpus", "none", "--results", str(tmp_path),
                                         "--workers", "2", "--max-steps", "10000000", "--checkpoint-every", "1",
                                         "--progress", "plain", "--json"),
                            cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run = wait_for(lambda: next((p for p in tmp_path.iterdir() if (p / "status.json").exists()), None), 120,
                       "the run to start")
        wait_for(lambda: status_of(run).get("updates", 0) >= 2, 120, "a checkpoint or two")
        os.rename(run / "checkpoints", run / "checkpoints-moved")  # at once, whatever the master writes
        (run / "checkpoints").write_text("not a directory\n")
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 7, err[-3000:]  # RUN_FAILED
    assert only_run(tmp_path) == run

    error = read_json(run / "summary.json")["error"]
    assert read_json(run / "summary.json")["outcome"] == "failed"
    # Which write meets the file first (TensorFlow's or numpy's, and at which step of TF's save) is a race: each
    # names it, TF's SaveV2 sometimes as NotFoundError on a path under the file (CI 22:53).
    assert error["type"] in ("FailedPreconditionError", "NotADirectoryError", "NotFoundError"), error
    assert any(w in error["message"].lower() for w in ("not a directory", "no such file or directory")), error
    assert error["where"].startswith("writing a checkpoint"), error
    line = f"{error['type']}: {error['message'][:80]}"

    result: dict[str, Any] = json.loads(out)
    assert result == read_json(run / "result.json")
    assert result["state"] == "failed" and result["error"].startswith(line), result
    assert line in result["message"] and "master.log" in result["message"]

    status = run_launcher("status", run.name, "--results", str(tmp_path), "--json")
    doc = json.loads(status.stdout)
    assert (doc["state"], doc["outcome"]) == ("failed", "failed") and doc["error"].startswith(line), doc
    text = run_launcher("status", run.name, "--results", str(tmp_path)).stdout
    assert f"error       {line}" in text, text

    end = [parse_plain_line(raw) for raw in err.splitlines() if " end " in raw][-1]
    assert end[1] == "end" and (end[2]["error"] or "").startswith(line), end  # the progress output's last line
    assert processes_mentioning(str(tmp_path)) == []


def test_an_exception_outside_the_masters_loop_still_reaches_summary_json(tmp_path: Path) -> None:
    """What escapes Master.run (its imports, its construction) used to leave only an exit code."""
    from worker.__main__ import master_crashed

    spec = RunSpec(run_id="cartpole-ppo-crash-0001", env_id="CartPole-v1", algo="ppo", results_dir=str(tmp_path))
    try:
        raise ImportError("libcudart.so.12: cannot open shared object file")
    except ImportError as exc:
        assert master_crashed(spec, exc, summary_written=False) == EXIT_FAILED
    summary = read_json(tmp_path / "summary.json")
    assert summary["outcome"] == "failed" and summary["error"]["type"] == "ImportError"
    assert summary["error"]["message"] == "libcudart.so.12: cannot open shared object file"
    assert summary["error"]["where"].startswith("the master (test_root_cause.py:")
    (tmp_path / "summary.json").write_text('{"outcome": "max_steps"}')
    master_crashed(spec, RuntimeError("after the summary"), summary_written=True)
    assert read_json(tmp_path / "summary.json") == {"outcome": "max_steps"}, "a written summary is left alone"


def test_a_group_that_dies_of_an_exception_says_what_last(tmp_path: Path) -> None:
    """A real group process whose envs cannot be made: it exits 1 (a crash: the supervisor may restart it) and its
    last line on stderr, its log, names the exception, which the supervisor reads (test_supervisor.py)."""
    from worker.contract import GroupAssignment
    from worker.ending import last_fatal

    spec = RunSpec(run_id="cartpole-ppo-crash-0002", env_id="NoSuchEnvAnywhere-v0", algo="ppo",
                   results_dir=str(tmp_path), groups=(GroupAssignment(0, 1),))
    (tmp_path / "spec.json").write_text(spec.to_json())
    proc = subprocess.run([sys.executable, "-m", "worker", "group", "--index", "0", "--spec", str(tmp_path / "spec.json")],
                          cwd=ROOT, env=child_env(LAUNCHER_SECRET="s" * 32), capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_FAILED, proc.stderr[-2000:]
    error = last_fatal(proc.stderr)
    assert error is not None and "NoSuchEnvAnywhere" in error["message"], proc.stderr[-2000:]
    assert error["type"] == "EnvError" and error["where"].startswith("group 0: starting")
    assert proc.stderr.rstrip().splitlines()[-1].startswith("launcher-fatal: "), "the fatal line comes last"


def test_the_progress_outputs_last_line_names_the_error() -> None:
    """The live view's last line and the plain `end` line, from the result document `up` hands its reporter."""
    import io

    from rich.console import Console

    from launcher.progress import PlainReporter
    from launcher.progress_live import LiveReporter

    error = "FailedPreconditionError: checkpoints is not a directory (in writing a checkpoint (file_io.py:513))"
    doc = {"run_id": "r1", "state": "failed", "exit_code": 7, "message": "the master exited with code 1", "error": error,
           "summary": {}, "wall_s": 3.0}
    plain = io.StringIO()
    PlainReporter(plain, gpu_reader=None)("result", doc)
    _, kind, fields = parse_plain_line(plain.getvalue().splitlines()[-1])
    assert kind == "end" and fields["error"] == error and fields["state"] == "failed"

    screen = io.StringIO()
    live = LiveReporter(console=Console(file=screen, width=400, force_terminal=False), gpu_reader=None)
    try:
        live("result", doc)
    finally:
        live.close()
    last = [line for line in screen.getvalue().splitlines() if line.strip()][-1]
    assert f"failed: the master exited with code 1 (raised {error})" in last, screen.getvalue()


def test_launcher_status_names_what_a_dead_group_raised(tmp_path: Path, capsys: Any) -> None:
    """A group has no results directory: its root cause is the fatal line it wrote last in its log, which
    `launcher status` (text and --json) shows beside the part. The group here is a real process that died."""
    from launcher import schemas
    from launcher.cli.main import main
    from launcher.runs import create_run_dir
    from worker.ending import error_doc, fatal_line

    rd = create_run_dir(tmp_path, "cartpole-ppo-groupdied-0003")
    (rd.path / "spec.json").write_text("{}")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    rd.update_record(backend="process", state="failed", exit_code=7, pids={"group-0": gone.pid})
    try:
        raise OSError(28, "No space left on device")
    except OSError as exc:
        doc = error_doc(exc, "group 0")
    (rd.files.logs / "group-0.log").write_text(f"INFO playing\nTraceback (most recent call last):\n{fatal_line(doc)}\n")
    assert main(["status", rd.run_id, "--results", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    schemas.validator(schemas.RUN_STATUS_SCHEMA).validate(out)
    (part,) = out["parts"]
    assert part["name"] == "group-0" and part["error"].startswith("OSError: [Errno 28] No space left on device (in group 0")
    assert main(["status", rd.run_id, "--results", str(tmp_path)]) == 0
    assert "raised OSError: [Errno 28] No space left on device" in capsys.readouterr().out
