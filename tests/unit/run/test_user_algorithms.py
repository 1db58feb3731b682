"""The user's own algorithm and model (issue 22): a file of user code runs like a built-in (checkpoints, resume,
metrics, status, eval), ``--set help`` lists its hyper-parameters, a model with a layer that has no numpy
implementation trains with TensorFlow in the groups, and bad user code gets one clear answer with nothing left
running. Real runs on the process backend; the user code is real files in tests/data/usercode/."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers import ROOT, only_run, processes_mentioning, read_json, run_launcher

CODE = ROOT / "tests" / "data" / "usercode"
REINFORCE = f"{CODE / 'reinforce.py'}:Reinforce"


def up(tmp_path: Path, *args: str, algo: str = REINFORCE, workers: str = "2") -> Any:
    return run_launcher("up", "--backend", "process", "--gpus", "none", "--workers", workers, "--algo", algo,
                        "--results", str(tmp_path), "--progress", "off", *args)


def assert_nothing_left(tmp_path: Path) -> None:
    assert processes_mentioning(str(tmp_path)) == [], "a process of the run is still alive"


def test_a_user_algorithm_has_everything_a_builtin_has(tmp_path: Path) -> None:
    proc = up(tmp_path, "--max-steps", "3000", "--checkpoint-every", "2", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    run = only_run(tmp_path)
    assert run.name.startswith("cartpole-reinforce-")  # named after the user's class
    summary = read_json(run / "summary.json")
    assert summary["outcome"] == "max_steps" and summary["updates"] >= 2 and summary["acting"] == "numpy"
    assert summary["algo"] == "reinforce:Reinforce" and result["summary"]["env_steps"] == summary["env_steps"]
    status = read_json(run / "status.json")
    assert status["acting"]["path"] == "numpy" and "matched Keras" in status["acting"]["reason"]
    assert set(status["losses"]) >= {"loss", "advantage"}  # what the user's update returned
    # Every payload fitted its schema (a slow start may still cost a handshake or two: not payloads).
    assert not [k for k in status["network"] if k.startswith("rejected.schema")], status["network"]
    for name in ("model/policy.json", "model/policy.npz", "model/final_model.keras", "learning_curve.png",
                 "checkpoints/checkpoint", "logs/master.log", "logs/group-0.log"):
        assert (run / name).is_file(), name
    assert list((run / "tensorboard").iterdir()), "no TensorBoard events"
    assert "acts with numpy" in (run / "logs" / "group-0.log").read_text()

    shown = run_launcher("status", run.name, "--results", str(tmp_path), "--json")
    assert shown.returncode == 0 and json.loads(shown.stdout)["run_id"] == run.name
    played = run_launcher("eval", run.name, "--results", str(tmp_path), "--episodes", "2", "--json")
    assert played.returncode == 0, played.stderr
    assert json.loads(played.stdout)["acting"] == "numpy"

    resumed = up(tmp_path, "--resume", run.name, "--max-steps", str(summary["env_steps"] + 2000))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = read_json(run / "summary.json")
    assert after["env_steps"] >= summary["env_steps"] + 2000 and after["updates"] > summary["updates"]
    assert_nothing_left(tmp_path)


def test_set_help_lists_the_hyper_parameters(tmp_path: Path) -> None:
    proc = up(tmp_path, "--set", "help")
    assert proc.returncode == 0, proc.stderr
    assert "hyper-parameters of" in proc.stdout and "Reinforce" in proc.stdout
    assert "lr" in proc.stdout and "Adam learning rate" in proc.stdout and "0.003" in proc.stdout
    builtin = run_launcher("up", "--backend", "process", "--env", "Pendulum-v1", "--algo", "ppo", "--set", "help")
    assert builtin.returncode == 0 and "clip" in builtin.stdout and "PPO clipping range" in builtin.stdout
    assert "gamma" in builtin.stdout and "0.9 " in builtin.stdout  # resolved for this env (Pendulum's 0.9)
    assert not list(tmp_path.iterdir())  # nothing was started


@pytest.mark.parametrize("algo,says", [
    (f"{CODE / 'broken_import.py'}:Anything", "No module named 'no_such_package_for_launcher_tests'"),
    (f"{CODE / 'reinforce.py'}:Nope", "has no 'Nope'"),
    (f"{CODE / 'reinforce.py'}:ReinforceActor", "not a subclass of worker.api.Algorithm"),
    ("no_such_module_anywhere:Algo", "module 'no_such_module_anywhere' cannot be imported"),
    (f"{CODE / 'missing.py'}:Algo", "no such file"),
])
def test_user_code_that_cannot_be_loaded_stops_before_anything_starts(tmp_path: Path, algo: str, says: str) -> None:
    proc = up(tmp_path, "--max-steps", "1000", algo=algo)
    assert proc.returncode == 2, proc.stderr  # BAD_INPUT
    first = proc.stderr.splitlines()[0]
    assert first.startswith("launcher: error: ") and says in proc.stderr, proc.stderr
    assert "nothing was started" in proc.stderr or "no such file" in proc.stderr
    assert "HINT:" in proc.stderr
    assert not list(tmp_path.iterdir())  # no run directory, no process
    assert_nothing_left(tmp_path)


def test_an_unknown_hyper_parameter_of_a_user_algorithm_is_refused_where_it_runs(tmp_path: Path) -> None:
    proc = up(tmp_path, "--max-steps", "1000", "--set", "learning_rate=0.1")
    assert proc.returncode == 2
    assert "unknown" in proc.stderr and "'learning_rate'" in proc.stderr and "known: fault, gamma, lr" in proc.stderr
    assert "--set help" in proc.stderr  # the hint says where the list is
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("fault,error,where,log", [
    ("actor_init", "RuntimeError: the actor refused to start (fault=actor_init)", "group 0", "group-0.log"),
    ("collect", "RuntimeError: the actor broke while collecting (fault=collect)", "group 0", "group-0.log"),
    ("update", "ZeroDivisionError: the learner divided by zero (fault=update)", "the learner's update", "master.log"),
])
def test_user_code_that_raises_ends_the_run_with_its_error(tmp_path: Path, fault: str, error: str, where: str,
                                                            log: str) -> None:
    proc = up(tmp_path, "--max-steps", "100000", "--set", f"fault={fault}", "--json")
    assert proc.returncode == 7, proc.stderr[-3000:]  # RUN_FAILED
    run = only_run(tmp_path)
    summary = read_json(run / "summary.json")
    assert summary["outcome"] == "failed"
    assert f"{summary['error']['type']}: {summary['error']['message']}" == error
    assert summary["error"]["where"].startswith(where) and "reinforce.py" in summary["error"]["where"]
    result = json.loads(proc.stdout)
    assert error in result["message"] and log in result["message"]  # up --json: the root cause and the log
    shown = run_launcher("status", run.name, "--results", str(tmp_path))
    assert error in shown.stdout, shown.stdout  # launcher status names it too
    traceback = (run / "logs" / log).read_text()
    assert "Traceback (most recent call last)" in traceback and error.split(": ")[1] in traceback
    if fault != "update":  # the group tells the master; the supervisor does not restart it
        assert "not restarted" in proc.stderr or "restarting it" not in proc.stderr
    assert_nothing_left(tmp_path)


def test_a_payload_that_breaks_its_own_schema_is_refused_naming_the_field(tmp_path: Path) -> None:
    proc = up(tmp_path, "--max-steps", "2000", "--set", "fault=bad_field", workers="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = only_run(tmp_path)
    status = read_json(run / "status.json")
    assert status["network"].get("rejected.schema:obs", 0) >= 1, status["network"]
    assert "payload field 'obs' has dtype float64, the schema says float32" in (run / "logs" / "master.log").read_text()
    assert read_json(run / "summary.json")["updates"] >= 1  # the good payloads trained on
    assert_nothing_left(tmp_path)


def test_non_finite_weights_stop_the_run_and_keep_the_last_good_checkpoint(tmp_path: Path) -> None:
    proc = up(tmp_path, "--max-steps", "100000", "--set", "fault=diverge", "--checkpoint-every", "1")
    assert proc.returncode == 7, proc.stderr[-3000:]
    run = only_run(tmp_path)
    summary = read_json(run / "summary.json")
    assert summary["error"]["type"] == "FloatingPointError" and "non-finite weights" in summary["error"]["message"]
    assert "last good checkpoint is kept" in summary["error"]["message"]
    policies = sorted((run / "checkpoints").glob("policy-*.npz"), key=lambda p: int(p.stem.split("-")[1]))
    assert policies and int(policies[-1].stem.split("-")[1]) == 3  # updates 1-3; the 4th made NaN: never saved
    saved = np.load(policies[-1])
    assert all(np.isfinite(saved[k]).all() for k in saved.files)
    assert not (run / "model" / "policy.npz").exists()  # nothing of the non-finite weights was exported
    played = run_launcher("eval", run.name, "--results", str(tmp_path), "--checkpoint", "latest", "--episodes", "1")
    assert played.returncode == 0, played.stderr  # the last good checkpoint plays
    assert_nothing_left(tmp_path)


def test_a_layer_with_no_numpy_implementation_trains_with_tensorflow_in_the_groups(tmp_path: Path) -> None:
    model = f"{CODE / 'custom_model.py'}:build"
    proc = up(tmp_path, "--model", model, "--max-steps", "3000", algo="ppo")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = only_run(tmp_path)
    summary = read_json(run / "summary.json")
    assert summary["acting"] == "tensorflow" and summary["updates"] >= 1
    status = read_json(run / "status.json")
    assert "Scaled" in status["acting"]["reason"] and "is not a stock Keras layer" in status["acting"]["reason"]
    assert "acts with tensorflow" in (run / "logs" / "group-0.log").read_text()
    played = run_launcher("eval", run.name, "--results", str(tmp_path), "--episodes", "1", "--json",
                          "--code", str(CODE / "custom_model.py"))
    assert played.returncode == 0, played.stderr
    assert json.loads(played.stdout)["acting"] == "tensorflow"
    refused = run_launcher("eval", run.name, "--results", str(tmp_path), "--episodes", "1")
    assert refused.returncode == 2 and "--code" in refused.stderr  # the custom layer needs the user's code
    assert_nothing_left(tmp_path)
