"""`launcher runs`, --resume after SIGTERM and after a killed launcher (stale), and --timeout (exit 4)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import jsonschema

from launcher import schemas
from launcher.history import describe, history
from launcher.runs import RunDir
from tests.helpers import ROOT, child_env, launcher_cmd, processes_mentioning, read_json, run_launcher, status_of, wait_for, run_dirs
from tests.run_fixtures import TARGET_RETURN, CliRun


def runs_json(root: Path) -> dict[str, Any]:
    out = run_launcher("runs", "--results", str(root), "--json", timeout=60)
    assert out.returncode == 0, out.stderr
    doc: dict[str, Any] = json.loads(out.stdout)
    jsonschema.validate(doc, schemas.load(schemas.RUNS_SCHEMA))
    return doc


def test_runs_lists_a_finished_run(trained_cartpole: CliRun) -> None:
    run = trained_cartpole.run_dir
    doc = runs_json(trained_cartpole.root)
    assert doc["results_root"] == str(trained_cartpole.root.resolve())
    (row,) = doc["runs"]
    summary = read_json(run / "summary.json")
    assert row["run_id"] == run.name and row["path"] == str(run.resolve())
    assert (row["env_id"], row["algo"], row["workers"], row["backend"]) == ("CartPole-v1", "ppo", 8, "process")
    assert (row["status"], row["exit_code"], row["outcome"]) == ("finished", 0, "target_reached")
    assert row["last_return"] == summary["mean_return"] >= TARGET_RETURN
    assert row["best_return"] == summary["best_mean_return"] and row["steps"] == summary["env_steps"]
    assert 0 < row["duration_s"] <= trained_cartpole.wall_s
    table = run_launcher("runs", "--results", str(trained_cartpole.root), timeout=60)
    header, line = table.stdout.splitlines()
    assert header.split()[:6] == ["RUN", "ENV", "ALGO", "WORKERS", "STATUS", "BEST"]
    assert line.split()[:5] == [run.name, "CartPole-v1", "ppo", "8", "finished"] and line.endswith(str(run.resolve()))
    empty = run_launcher("runs", "--results", str(trained_cartpole.root / "nothing-here"), timeout=60)
    assert empty.returncode == 0 and empty.stdout == "" and "no runs under" in empty.stderr


def _start(root: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(launcher_cmd("up", "--backend", "process", "--gpus", "none", "--results", str(root),
                                         "--progress", "off", *args),
                            cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _row(run: Path) -> dict[str, Any]:
    row: dict[str, Any] = next(r for r in runs_json(run.parent)["runs"] if r["run_id"] == run.name)
    return row


def test_sigterm_then_kill_then_resume_keeps_counting(tmp_path: Path) -> None:
    """Stop with SIGTERM (interrupted), resume, kill -9 the launcher (stale), resume to the end."""
    proc = _start(tmp_path, "--workers", "4", "--groups", "2", "--max-steps", "10000000", "--checkpoint-every", "5")
    run = wait_for(lambda: next((p for p in run_dirs(tmp_path) if (p / "status.json").exists()), None), 120,
                   "the run to start")
    wait_for(lambda: status_of(run).get("updates", 0) >= 6, 120, "a few updates")
    assert _row(run)["status"] == "running"
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 130
    first = read_json(run / "summary.json")
    assert read_json(run / "result.json")["state"] == "interrupted"
    row = _row(run)
    assert (row["status"], row["exit_code"], row["steps"]) == ("interrupted", 130, first["env_steps"])

    # Resume, then kill the launcher outright: its children follow it, run.json still says "running".
    proc = _start(tmp_path, "--resume", run.name, "--max-steps", "10000000")
    wait_for(lambda: status_of(run).get("env_steps", 0) > first["env_steps"] and status_of(run).get("state") == "running",
             120, "the resumed run to go on")
    proc.kill()
    proc.wait()
    wait_for(lambda: not processes_mentioning(str(run)), 20, "the children to die with their launcher")
    assert read_json(run / "run.json")["state"] == "running"
    row = _row(run)
    assert row["status"] == "stale" and row["recorded_state"] == "running" and row["exit_code"] is None
    second = status_of(run)

    # Resume from the stale record: the counters go on from the last checkpoint.
    target = second["env_steps"] + 4000
    done = run_launcher("up", "--resume", run.name, "--results", str(tmp_path), "--max-steps", str(target),
                        "--backend", "process", "--gpus", "none", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["state"] == "finished" and result == read_json(run / "result.json")
    final = read_json(run / "summary.json")
    assert final["env_steps"] >= target and final["updates"] > first["updates"]
    starts = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
              if '"master_started"' in line]
    assert len(starts) == 3
    assert starts[1]["env_steps"] == first["env_steps"] and starts[1]["updates"] == first["updates"]
    assert first["env_steps"] <= starts[2]["env_steps"] <= second["env_steps"]  # the last checkpoint before the kill
    row = _row(run)
    assert (row["status"], row["exit_code"], row["steps"]) == ("finished", 0, final["env_steps"])
    assert [r.run_id for r in history(tmp_path)] == [run.name]  # resumed in place


def test_timeout_tears_down_and_exits_4(tmp_path: Path) -> None:
    t0 = time.monotonic()
    out = run_launcher("up", "--backend", "process", "--gpus", "none", "--workers", "2", "--max-steps", "none",
                       "--timeout", "8s", "--results", str(tmp_path), "--json", timeout=120)
    took = time.monotonic() - t0
    assert out.returncode == 4, out.stderr[-3000:]
    (run,) = [p for p in run_dirs(tmp_path) if p.is_dir()]
    result = json.loads(out.stdout)
    jsonschema.validate(result, schemas.load(schemas.RESULT_SCHEMA))
    assert (result["state"], result["exit_code"], result["message"]) == ("timed_out", 4, "--timeout 8 s elapsed")
    assert result == read_json(run / "result.json")
    record = read_json(run / "run.json")
    assert record["state"] == "timed_out" and record["exit_code"] == 4
    assert not processes_mentioning(str(run)), "a process of the run outlived the launcher"
    assert read_json(run / "summary.json")["outcome"] == "interrupted"  # the master checkpointed on its way out
    assert took < 8 + 40, took  # start-up, 8 s of running, and a teardown of at most the grace period
    row = describe(RunDir(run.name, run))
    assert (row.status, row.exit_code) == ("timed_out", 4)
    assert "end" in out.stderr and "state=timed_out exit_code=4" in out.stderr
