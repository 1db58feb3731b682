"""Env options of ``launcher up`` (``--env-arg``, ``[up.env_args]``, ``--env-dir``, ``--with``, ``[build] with``)
and the env check before a run, with real processes: runs of a user's module and of an installed package
through the process backend, and the check refusing a missing module (exit 6) before anything is written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.cli.main import main
from launcher.config import RunConfig, load_config, validate
from launcher.config.layers import build_with_from_file
from launcher.config.options import parse_env_arg
from launcher.errors import ConfigErrors
from tests.helpers import child_env, launcher_cmd

DATA = Path(__file__).resolve().parents[2] / "data"
USER_DIR = DATA / "userenv"


@pytest.mark.parametrize("text, expected", [
    ("use_lidar=false", ("use_lidar", False)), ("use_lidar=True", ("use_lidar", True)), ("n=3", ("n", 3)),
    ("lr=2.5e-3", ("lr", 0.0025)), ('mode="hard mode"', ("mode", "hard mode")), ("mode=hard", ("mode", "hard")),
    ("day=2024-01-01", ("day", "2024-01-01")), (" size = 8 ", ("size", 8)),
])
def test_env_arg_values_are_toml_scalars(text: str, expected: tuple[str, object]) -> None:
    assert parse_env_arg(text) == expected
    assert type(parse_env_arg(text)[1]) is type(expected[1])


@pytest.mark.parametrize("text, message", [
    ("use_lidar", "--env-arg takes key=value, got 'use_lidar'"),
    ("=3", "--env-arg takes key=value, got '=3'"),
    ("1x=3", "--env-arg '1x=3': the key '1x' is not a keyword argument name"),
    ("k=", "--env-arg 'k=': no value after '='"),
    ("k=[1, 2]", "--env-arg 'k=[1, 2]': only scalars"),
    ("k='open", "--env-arg \"k='open\": the quoted string is not closed"),
])
def test_bad_env_args_name_the_flag_and_value(text: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError) as err:
        parse_env_arg(text)
    assert message in str(err.value)
    # Through the CLI: one message on stderr, exit 2, nothing started.
    code = main(["up", "--backend", "process", "--env-arg", text, "--max-steps", "10"])
    err_text = capsys.readouterr().err
    assert code == 2 and message in err_text and "HINT: example: --env-arg" in err_text


def test_env_args_from_the_config_file_and_flags_on_top(tmp_path: Path) -> None:
    f = tmp_path / "launcher.toml"
    f.write_text('[up]\nenv = "lab_env:LabTiny-v0"\nenv-dir = "/data/envs"\n\n'
                 '[up.env_args]\nlength = 12\nmode = "hard"\nweights = [1, 2]\n\n[build]\nwith = ["ale-py"]\n')
    cfg, origin = load_config({"env_args": {"mode": "easy"}}, config_path=f, environ={})
    assert dict(cfg.env_args) == {"length": 12, "mode": "easy", "weights": [1, 2]}
    assert origin["env_args"] == f"file {f} + flag --env-arg"
    assert cfg.env_dir == Path("/data/envs") and cfg.with_packages == ("ale-py",), "[build] with feeds up's --with"
    assert cfg.to_dict()["env_args"] == {"length": 12, "mode": "easy", "weights": [1, 2]}
    assert cfg.to_dict()["with_packages"] == ["ale-py"] and cfg.to_dict()["env_dir"] == "/data/envs"
    # [up] with wins over [build] with; flags win over both.
    f.write_text('[up]\nwith = ["dist/x.whl"]\n[build]\nwith = ["ale-py"]\n')
    assert load_config({}, config_path=f, environ={})[0].with_packages == ("dist/x.whl",)
    assert load_config({"with_packages": ["flappy-bird-gymnasium"]}, config_path=f,
                       environ={})[0].with_packages == ("flappy-bird-gymnasium",)
    assert load_config({}, environ={"LAUNCHER_WITH": "a b==1"}, cwd=tmp_path)[0].with_packages == ("a", "b==1")
    assert build_with_from_file(f) == (("ale-py",), f)


@pytest.mark.parametrize("text, message", [
    ("[up.env_args]\nrender_mode = 'human'\n", "[up.env_args] render_mode: set by the launcher itself"),
    ("[up.env_args]\nnested = {a = 1}\n", "[up.env_args] nested={\"a\": 1}: only scalars"),
    ("[up]\nenv_args = 3\n", "[up] env_args = 3: expected a table ([up.env_args]), got integer"),
    ("[build]\nwith = 'ale-py'\n", "[build] with = \"ale-py\": expected an array of strings, got string"),
    ("[build]\nwhith = ['x']\n", "unknown key 'whith' in [build]; known keys: with"),
])
def test_bad_env_tables_name_the_file_key_and_value(tmp_path: Path, text: str, message: str) -> None:
    f = tmp_path / "launcher.toml"
    f.write_text(text)
    with pytest.raises(ConfigErrors) as err:
        load_config({}, config_path=f, environ={})
    assert message in err.value.message and str(f) in err.value.message


def test_validate_checks_the_env_name_directory_and_wheels(tmp_path: Path) -> None:
    problems = validate(RunConfig(env_id="a b:X-v0", env_dir=tmp_path / "nope", results=tmp_path,
                                  with_packages=("ale-py", str(tmp_path / "missing.whl"))))
    text = "\n".join(problems)
    assert "--env 'a b:X-v0' is not a gymnasium id or module:EnvId" in text
    assert f"--env-dir {tmp_path / 'nope'} is not a directory" in text
    assert f"--with {tmp_path / 'missing.whl'}: no such wheel file" in text
    assert "ale-py" not in text
    # The host does not need the env's module: whether it can be made is asked where the groups run.
    assert validate(RunConfig(env_id="not_on_this_host:X-v0", results=tmp_path)) == []


# --------------------------------------------------------------------------------- real process-backend runs
def _up(root: Path, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(launcher_cmd("up", "--backend", "process", "--gpus", "none", "--workers", "2",
                                       "--results", str(root), "--progress", "off", "--json", *args),
                          cwd=cwd or root.parent, env=child_env(**(env or {})), capture_output=True, text=True,
                          timeout=300)


def test_a_user_module_runs_through_the_process_backend_with_env_args_from_file_and_flag(tmp_path: Path) -> None:
    root = tmp_path / "results"
    (tmp_path / "launcher.toml").write_text(f'[up]\nenv-dir = "{USER_DIR}"\n\n[up.env_args]\nlength = 10\n')
    done = _up(root, "--env", "lab_env:LabTiny-v0", "--env-arg", "length=8", "--max-steps", "2000",
               cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["state"] == "finished" and result["summary"]["env_steps"] >= 2000
    run = root / result["run_id"]
    config = json.loads((run / "config.json").read_text())
    assert config["env_id"] == "lab_env:LabTiny-v0" and config["env_args"] == {"length": 8}
    assert config["env_dir"] == str(USER_DIR)
    assert json.loads((run / "spec.json").read_text())["env_args"] == {"length": 8}
    for name in ("summary.json", "metrics.jsonl", "model/policy.npz", "logs/group-0.log"):
        assert (run / name).is_file(), name
    episodes = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                if '"episodes"' in line]
    lengths = [n for rec in episodes for g in (rec.get("groups") or {}).values() for n in g.get("lengths", [])] or \
        [n for rec in episodes for n in rec.get("lengths", [])]
    assert lengths and set(lengths) == {8}, "every episode lasted length=8 steps: the flag beat the file's 10"


def test_an_installed_package_runs_through_the_process_backend(tmp_path: Path) -> None:
    # Installed for real (pip install of its wheel), into a directory on the launcher's PYTHONPATH, so the
    # shared venv stays as it is; the groups inherit that path as they would a venv's site-packages.
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
                    str(DATA / "envpkg")], check=True, capture_output=True, timeout=300)
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                    *map(str, wheels.glob("*.whl"))], check=True, capture_output=True, timeout=300)
    root = tmp_path / "results"
    done = _up(root, "--env", "launcher_test_envpkg:TinyPkg-v0", "--env-arg", "length=5", "--max-steps", "2000",
               env={"PYTHONPATH": str(site)})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["state"] == "finished"
    assert (root / result["run_id"] / "summary.json").is_file()


def test_the_env_check_refuses_a_missing_module_before_anything_is_written(tmp_path: Path) -> None:
    root = tmp_path / "results"
    done = _up(root, "--env", "lab_env:LabTiny-v0", "--max-steps", "2000")  # no --env-dir
    assert done.returncode == 6, done.stderr
    assert "--env 'lab_env:LabTiny-v0' cannot be made where the worker groups will run (this host's Python" in done.stderr
    assert "module 'lab_env' cannot be imported" in done.stderr and "nothing was started" in done.stderr
    assert "HINT: install it for this Python" in done.stderr and "--env-dir DIR" in done.stderr
    assert done.stdout == ""
    assert not root.exists() or not any(root.iterdir()), "no run directory is left behind"
    done = _up(root, "--env", "lab_env:LabTiny-v0", "--env-dir", str(USER_DIR), "--env-arg", "colour=red",
               "--max-steps", "2000")
    assert done.returncode == 2 and "does not take the arguments ['colour']" in done.stderr
    assert not root.exists() or not any(root.iterdir())


def test_refusals_say_what_to_add_for_containers_and_for_this_host() -> None:
    from launcher.backends.envcheck import EnvProbe, refusal
    from launcher.errors import BadInput, ExitCode, MissingDependency

    cfg = RunConfig(env_id="flappy_bird_gymnasium:FlappyBird-v0")
    missing = EnvProbe("image launcher:0.1.0-cpu as uid:gid 1000:1000, no network",
                       error={"kind": "missing_module", "module": "flappy_bird_gymnasium", "package": "flappy-bird-gymnasium",
                              "message": "module 'flappy_bird_gymnasium' cannot be imported here"})
    err = refusal(cfg, missing, containers=True)
    assert isinstance(err, MissingDependency) and err.exit_code == ExitCode.MISSING_DEPENDENCY
    assert "(image launcher:0.1.0-cpu as uid:gid 1000:1000, no network)" in err.message
    assert "`launcher up --with flappy-bird-gymnasium ...`" in (err.hint or "")
    assert "launcher build --with flappy-bird-gymnasium" in (err.hint or "") and "--env-dir DIR" in (err.hint or "")
    host = refusal(cfg, EnvProbe("this host's Python /v/bin/python", error=missing.error, python="/v/bin/python"),
                   containers=False)
    assert "`/v/bin/python -m pip install flappy-bird-gymnasium`" in (host.hint or "")
    atari = refusal(RunConfig(env_id="ALE/Pong-v5"), EnvProbe("image x", error={"kind": "missing_module",
                    "module": "ale_py", "package": "ale-py", "message": "no ale_py"}), containers=True)
    assert "--with ale-py --with opencv-python-headless" in (atari.hint or "")
    lib = refusal(cfg, EnvProbe("image x", error={"kind": "missing_library", "missing": "libgthread-2.0.so.0",
                                                  "package": "libglib2.0-0", "message": "a system library..."}),
                  containers=True)
    assert isinstance(lib, MissingDependency) and "libglib2.0-0" in (lib.hint or "") and "Python packages only" in \
        (lib.hint or "")
    typo = refusal(cfg, EnvProbe("image x", error={"kind": "unknown_id", "message": "did you mean"}), containers=True)
    assert isinstance(typo, BadInput) and typo.exit_code == ExitCode.BAD_INPUT
