"""Issue 25 item 1: the host never acts on what a run's containers can write.

A Docker run's master gets the run's results directory read-write (``/results``); everything in it may have
been written by the run's own code. These tests write there what such a container could (a module of its own,
rewritten ``spec.json``/``config.json``/``run.json``) and check that ``eval``, ``up --resume`` and its env
check neither import the module nor take the rewritten backend, image, env dir or env id. The launcher's own
records live in ``<root>/.launcher/<run>/`` (:attr:`launcher.runs.RunDir.host`), which no container gets.
"""

from __future__ import annotations

import json
import subprocess
from contextlib import ExitStack
from pathlib import Path

import pytest

from launcher.config import RunConfig
from launcher.errors import BadInput
from launcher.runs import RunDir, create_run_dir
from launcher.up import prepare, resume_config
from tests.helpers import ROOT, child_env, launcher_cmd, read_json, run_launcher
from tests.policy_fixtures import export_builtin_policy

PLANTED = '''
import pathlib, gymnasium
pathlib.Path({marker!r}).write_text("imported")  # what the run's own code would do, on the host
from gymnasium.envs.classic_control import CartPoleEnv
gymnasium.register(id="Planted-v0", entry_point=CartPoleEnv, max_episode_steps=50)
'''
PLANTED_ENV = "planted_env:Planted-v0"


def plant(run: Path, marker: Path) -> None:
    """What a master container can do to its ``/results``: a module of its own, and the copies of the
    launcher's files rewritten to point at it (env id, env dir) and to run elsewhere (backend, image)."""
    (run / "planted_env.py").write_text(PLANTED.format(marker=str(marker)))
    for name, changes in (("spec.json", {"env_id": PLANTED_ENV}),
                          ("config.json", {"env_id": PLANTED_ENV, "env_dir": str(run), "backend": "docker",
                                           "image": "planted:latest"}),
                          ("run.json", {"backend": "docker", "env_id": PLANTED_ENV})):
        path = run / name
        doc = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**doc, **changes}))


def trained_looking_run(root: Path, rid: str) -> RunDir:
    """A run with the launcher's record of its spec (CartPole) and an exported policy, as a finished run has."""
    rd = create_run_dir(root, rid)
    rd.spec.write_text(json.dumps({"run_id": rid, "env_id": "CartPole-v1", "algo": "ppo", "return_window": 100,
                                   "hparams": {}, "env_args": {}}))
    (rd.path / "model").mkdir()
    export_builtin_policy(rd.path, "CartPole-v1", scale=0.05)
    return rd


def test_eval_never_imports_a_module_planted_in_the_run_directory(tmp_path: Path) -> None:
    """``python -m launcher eval`` started inside the run's directory (its working directory first on
    ``sys.path``), with the results' spec.json naming the planted module: before, the module ran in the
    launcher's own process. Now eval plays the env of the launcher's record and never imports it."""
    root, marker = tmp_path / "results", tmp_path / "imported"
    rd = trained_looking_run(root, "cartpole-ppo-20261125-000000-ev01")
    plant(rd.path, marker)
    out = subprocess.run(launcher_cmd("eval", rd.run_id, "--results", str(root), "--episodes", "2", "--json"),
                         cwd=rd.path, env=child_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    assert doc["env_id"] == "CartPole-v1" and len(doc["returns"]) == 2
    assert not marker.exists(), "eval imported the module planted in the run directory"


def test_eval_of_a_legacy_run_refuses_a_module_env_id_unless_given(tmp_path: Path) -> None:
    """A run made before the records moved has its spec only in its results: eval takes no module name from
    it (exit 2, the value seen and the flag to pass); given ``--env`` it plays."""
    root, marker = tmp_path / "results", tmp_path / "imported"
    run = root / "cartpole-ppo-20261125-000000-ev02"
    (run / "model").mkdir(parents=True)
    export_builtin_policy(run, "CartPole-v1", scale=0.05)
    (run / "spec.json").write_text(json.dumps({"run_id": run.name, "env_id": "CartPole-v1", "algo": "ppo"}))
    plant(run, marker)
    out = subprocess.run(launcher_cmd("eval", run.name, "--results", str(root), "--episodes", "1"), cwd=run,
                         env=child_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "names a module to import" in out.stderr and PLANTED_ENV in out.stderr, out.stderr
    assert f"--env {PLANTED_ENV}" in out.stderr  # the hint: check it, then pass it
    given = run_launcher("eval", run.name, "--results", str(root), "--episodes", "1", "--env", "CartPole-v1",
                         "--json", timeout=300)
    assert given.returncode == 0, given.stderr[-3000:]
    assert json.loads(given.stdout)["env_id"] == "CartPole-v1"
    assert not marker.exists()


def _prepared(root: Path) -> RunDir:
    """A run as ``launcher up`` prepares it (config, plan, spec and record written, the env checked), not
    started: what ``--resume`` starts from."""
    cfg = RunConfig(env_id="CartPole-v1", workers=2, groups=1, backend="process", gpus="none", results=root,
                    max_steps=1000)
    with ExitStack() as stack:
        run = prepare(cfg, stack).run
    return run.run_dir


def test_resume_takes_nothing_from_the_container_writable_copies(tmp_path: Path) -> None:
    """The results' config.json says backend docker, image planted:latest, env_dir the run directory and the
    planted env: before, `up --resume` took each (the module ran in the env probe, the master and group 0).
    Now the resumed run is the launcher's record's: process backend, CartPole, nothing imported."""
    root, marker = tmp_path / "results", tmp_path / "imported"
    rd = _prepared(root)
    plant(rd.path, marker)
    cfg = resume_config({}, root, rd.run_id)
    assert (cfg.backend, cfg.image, cfg.env_dir, cfg.env_id) == ("process", None, None, "CartPole-v1")
    out = run_launcher("up", "--resume", rd.run_id, "--results", str(root), "--max-steps", "600", "--json",
                       timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout)["state"] == "finished"
    assert not marker.exists(), "the resumed run (env check, master or a group) imported the planted module"
    record = read_json(rd.host / "run.json")
    assert record["backend"] == "process" and record["env_id"] == "CartPole-v1"
    assert read_json(rd.host / "spec.json")["env_id"] == "CartPole-v1"
    # The copies in the results are the launcher's values again (written for the user's tools, never read).
    assert read_json(rd.path / "config.json")["backend"] == "process"


USER_ENV = '''
import gymnasium
from gymnasium.envs.classic_control import CartPoleEnv
gymnasium.register(id="UserEnv-v0", entry_point=CartPoleEnv, max_episode_steps=50)
'''


def test_resume_from_inside_the_run_directory_imports_the_users_module_not_the_planted_one(tmp_path: Path) -> None:
    """The user's env is their own module (``--env-dir``); the run's container plants a module of the same name
    in the results. `up --resume` started from inside the run directory: ``python -m`` would put that directory
    first on ``sys.path`` of the env probe, the master and the groups, and the planted module would shadow the
    user's. They start with ``-P`` there, so the user's module is imported and the planted one never."""
    root, marker, envs = tmp_path / "results", tmp_path / "imported", tmp_path / "envs"
    envs.mkdir()
    (envs / "userenv_mod.py").write_text(USER_ENV)
    cfg = RunConfig(env_id="userenv_mod:UserEnv-v0", env_dir=envs, workers=2, groups=1, backend="process",
                    gpus="none", results=root, max_steps=1000)
    with ExitStack() as stack:
        rd = prepare(cfg, stack)[0].run_dir
    (rd.path / "userenv_mod.py").write_text(PLANTED.format(marker=str(marker)))
    out = subprocess.run(launcher_cmd("up", "--resume", rd.run_id, "--results", str(root.resolve()), "--max-steps",
                                      "600", "--json"), cwd=rd.path, env=child_env(PYTHONPATH=str(ROOT)),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout)["state"] == "finished"
    assert not marker.exists(), "a process of the resumed run imported the module planted in the run directory"


def test_resume_of_a_legacy_run_needs_its_code_and_backend_given_again(tmp_path: Path) -> None:
    """A legacy run's config.json (in its results only) is not taken for the env, backend, image or env dir:
    exit 2 listing what the file says and the flags to pass; given them, the rest (max steps, workers) is
    taken as before."""
    root = tmp_path / "results"
    run = root / "cartpole-ppo-20261125-000000-le01"
    run.mkdir(parents=True)
    (run / "spec.json").write_text(json.dumps({"run_id": run.name, "env_id": "CartPole-v1"}))
    saved = {**RunConfig(results=root).to_dict(), "schema": "launcher.config/v1", "env_id": PLANTED_ENV,
             "env_dir": str(run), "backend": "docker", "image": "planted:latest", "workers": 3, "max_steps": 5000}
    (run / "config.json").write_text(json.dumps(saved))  # every field, as an older launcher wrote it
    assert RunDir(run.name, run).legacy
    with pytest.raises(BadInput) as err:
        resume_config({}, root, run.name)
    named = str(err.value).rpartition("That file says: ")[2]
    assert sorted(part.split(" = ")[0] for part in named.split(", ")) == ["--backend", "--env", "--env-dir", "--image"]
    assert err.value.hint and f"--env {PLANTED_ENV}" in err.value.hint and "--backend docker" in err.value.hint
    cfg = resume_config({"env_id": "CartPole-v1", "env_dir": None, "backend": "process", "image": None}, root, run.name)
    assert (cfg.env_id, cfg.env_dir, cfg.backend, cfg.image) == ("CartPole-v1", None, "process", None)
    assert (cfg.workers, cfg.max_steps) == (3, 5000)


def test_status_and_runs_read_the_launchers_record_not_the_copy(tmp_path: Path) -> None:
    """`launcher runs` shows the backend and env of the launcher's record; the results' rewritten run.json
    is not what it shows."""
    root = tmp_path / "results"
    rd = _prepared(root)
    plant(rd.path, tmp_path / "imported")
    out = run_launcher("runs", "--results", str(root), "--json", timeout=60)
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)["runs"]
    assert (row["backend"], row["env_id"]) == ("process", "CartPole-v1")


def test_a_planted_records_directory_is_refused_not_followed(tmp_path: Path) -> None:
    """``<root>/.launcher`` as a link (to a directory the attacker reads), or a directory of another user (who
    could rename records in it): `up` refuses before writing anything there, saying how a shared root is set
    up."""
    import os

    root, elsewhere = tmp_path / "results", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    (root / ".launcher").symlink_to(elsewhere)
    with pytest.raises(BadInput, match="is a symbolic link") as err:
        create_run_dir(root, "cartpole-ppo-20261125-000000-ln01")
    assert err.value.hint and "install -d -m 1777" in err.value.hint
    assert list(elsewhere.iterdir()) == [] and [p.name for p in root.iterdir()] == [".launcher"]
    (root / ".launcher").unlink()
    if os.geteuid() == 0:
        (root / ".launcher").mkdir(mode=0o1777)
        os.chown(root / ".launcher", 4242, 4242)
        with pytest.raises(BadInput, match="owned by uid 4242"):
            create_run_dir(root, "cartpole-ppo-20261125-000000-ln02")
        os.chown(root / ".launcher", 0, 0)  # root's, sticky: the shared set-up
        rd = create_run_dir(root, "cartpole-ppo-20261125-000000-ln03")
        assert (rd.host / "run.json").exists() and not rd.legacy


def test_eval_takes_the_env_dir_the_run_was_started_with_from_the_launchers_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run of the user's own env module: eval finds the module through the ``--env-dir`` in the launcher's
    record (no flag needed), never through the results' config.json; an env dir inside the results is refused."""
    import sys

    from launcher.evaluate import evaluate

    monkeypatch.setattr(sys, "path", list(sys.path))  # eval puts the env dir on this process's path
    root, marker, envs = tmp_path / "results", tmp_path / "imported", tmp_path / "envs"
    envs.mkdir()
    (envs / "userenv_rec.py").write_text(USER_ENV.replace("UserEnv-v0", "UserEnvRec-v0"))
    rd = trained_looking_run(root, "cartpole-ppo-20261125-000000-ev03")
    spec = json.loads(rd.spec.read_text())
    rd.spec.write_text(json.dumps({**spec, "env_id": "userenv_rec:UserEnvRec-v0"}))
    rd.config.write_text(json.dumps({"env_dir": str(envs)}))
    plant(rd.path, marker)  # the results' config.json names the run directory as env_dir
    doc = evaluate(rd, episodes=1)
    assert doc["env_id"] == "userenv_rec:UserEnvRec-v0" and not marker.exists()
    rd.config.write_text(json.dumps({"env_dir": str(rd.path)}))
    with pytest.raises(BadInput, match="inside the run's results"):
        evaluate(rd, episodes=1)
    assert not marker.exists()


def test_down_cancels_a_slurm_job_only_when_slurm_names_it_for_the_run(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A record (here a legacy one, in the results its steps could write) naming another job of the user with
    ``owns_job``: before, `down` scancelled that whole job. Now the job goes only when Slurm's own name for
    it is the run's; else only the run's steps in it. Slurm's client is the one thing faked (no slurmctld)."""
    from launcher import lifecycle
    from launcher.backends.slurm_specs import job_name
    from launcher.slurm import commands
    from launcher.slurm.model import JobInfo

    root = tmp_path / "results"
    rid = "cartpole-ppo-20261125-000000-sl01"
    run = root / rid
    run.mkdir(parents=True)
    (run / "spec.json").write_text(json.dumps({"run_id": rid, "env_id": "CartPole-v1"}))
    (run / "run.json").write_text(json.dumps({"run_id": rid, "backend": "slurm", "state": "running",
                                              "slurm_job": "77", "owns_job": True}))
    names = {"77": "someone-elses-training"}
    cancelled: list[str] = []
    monkeypatch.setattr(commands, "job", lambda job_id: JobInfo(job_id, names[job_id],
                                                                "CANCELLED" if job_id in cancelled else "RUNNING", "",
                                                                ("n1",)))
    monkeypatch.setattr(commands, "steps", lambda job_id: [])
    monkeypatch.setattr(commands, "cancel", lambda target, signal=None: cancelled.append(target))
    report = lifecycle.down_run(root, rid, grace_s=1)
    assert cancelled == [] and report.jobs == [], "down cancelled a job Slurm does not name for the run"
    names["77"] = job_name(rid)
    lifecycle.down_run(root, rid, grace_s=1)
    assert cancelled == ["77"]
